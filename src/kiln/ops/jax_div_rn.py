"""float32 division rounded once to nearest in JAX, for the quantizers whose x / scale must round as the
spec's torch reference does.

jnp's `/` is not that everywhere. XLA's simplifier rewrites a division by a broadcast or a constant as
a product with the divisor's reciprocal (on a CPU about one quotient in three is then an ulp off), and
Pallas Triton lowers a float32 division to div.full.f32 (approximate, ~2 ulp). An x / scale an ulp off
next to an e4m3 / int8 rounding tie takes the other code: one element one step off, which a GEMM's
per-element check sees (fp8_block_linear's float32 fuzz case failed for ~0.06 % of seeds on the CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def div_rn(x, y, *, compiled: str | None = None):
    """x / y in float32, rounded once to nearest even; y (a scalar or broadcastable to x) is broadcast
    to x's shape. `compiled`: "triton" inside a Pallas Triton kernel compiled for a GPU (PTX's
    div.rn.f32, as Kiln's Triton kernels divide), "mosaic" inside a Mosaic kernel compiled for a TPU
    (plain `/`: Mosaic has no correctly rounded division to ask for); None in XLA or an interpreted
    kernel, where an optimization barrier keeps XLA's division as written (at the cost of
    materializing the broadcast divisor)."""
    x = jnp.asarray(x, jnp.float32)
    y = jnp.broadcast_to(jnp.asarray(y, jnp.float32), x.shape)
    if compiled == "triton":
        (quotient,) = plgpu.elementwise_inline_asm(
            "div.rn.f32 $0, $1, $2;",
            args=[x, y],
            constraints="=r,r,r",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
        )
        return quotient
    if compiled == "mosaic":
        return x / y
    if compiled is not None:
        raise ValueError(f"div_rn: compiled={compiled!r}, expected 'triton', 'mosaic' or None")
    return x / jax.lax.optimization_barrier(y)
