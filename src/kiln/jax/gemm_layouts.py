"""The GEMM family's older kiln.jax names, kept for the code that uses them (kiln.jax.llama_layer's
callers, users' JAX code): thin aliases of the entries generated from the op specs.

    matmul(x, w, bias=None, implementation=None)
        = kiln.jax.linear: x [..., K] @ w [N, K]^T (+ bias [N]) -> [..., N] in x's dtype
    w8a16_matmul(x, w_int8, scale, bias=None, implementation=None)
        = kiln.jax.w8a16_linear: (x [..., K] @ w_int8 [N, K]^T) * scale (+ bias) -> [..., N], with
          scale float32 [N] or [N, 1] (one per output channel)

Same validation (errors name the op: "linear: ...", "w8a16_linear: ..."), same kernels, jit-compatible.
"""

from __future__ import annotations

import jax

from kiln.ops import get_op
from kiln.ops.jax_bridge import jax_function

_linear = jax_function(get_op("linear"))
_w8a16_linear = jax_function(get_op("w8a16_linear"))


def matmul(
    x: jax.Array, w: jax.Array, bias: jax.Array | None = None, implementation: str | None = None
) -> jax.Array:
    """`x [..., K] @ w[N, K]^T (+ bias [N])` -> `[..., N]` in x's dtype (f32/f16/bf16); float32
    accumulation. `kiln.jax.linear` under its older name."""
    return _linear(x, w, bias, implementation=implementation)


def w8a16_matmul(
    x: jax.Array,
    w_int8: jax.Array,
    scale: jax.Array,
    bias: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """`(x [..., K] @ w_int8[N, K]^T) * scale[N] (+ bias)` -> `[..., N]` in x's dtype: int8 weights
    with per-output-channel float32 scales (scale may also be `[N, 1]`). `kiln.jax.w8a16_linear`
    under its older name."""
    return _w8a16_linear(x, w_int8, scale, bias, implementation=implementation)
