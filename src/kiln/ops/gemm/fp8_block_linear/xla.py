"""fp8_block_linear in jax.numpy (XLA): x quantized per token and group of block_k to e4m3 in float32
(quantize_groups), then x_q * s and w_fp8 * w_scale (per block) dequantized in float32 and multiplied
at full float32 precision: the spec's sum over groups with each product rounded once in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.ops.gemm.fp8_block_linear.spec import FP8_BLOCK_LINEAR
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_MAX
from kiln.ops.jax_div_rn import div_rn
from kiln.ops.pallas_common import pad_to, round_up


def quantize_groups(x, block_k: int, *, compiled: str | None = None):
    """x [M, K] -> (x_q e4m3 [M, G * block_k] zero-padded, s float32 [M, G]). Both divisions round
    once (div_rn), as the spec's torch reference divides: XLA's reciprocal product put an x / s an ulp
    off on an e4m3 rounding tie. `compiled`: as div_rn's."""
    m, k = x.shape
    padded = pad_to(x.astype(jnp.float32), 1, round_up(k, block_k))
    groups = padded.reshape(m, -1, block_k)
    amax = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), AMAX_FLOOR)
    scale = div_rn(amax, FP8_MAX, compiled=compiled)
    quotient = div_rn(groups, scale[..., None], compiled=compiled)
    q = jnp.clip(quotient, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(m, -1), scale


def fp8_block_linear_xla(x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=jnp.bfloat16):
    m, n = x.shape[0], w_fp8.shape[0]
    xq, xs = quantize_groups(x, block_k)
    groups = xs.shape[1]
    x_deq = (xq.astype(jnp.float32).reshape(m, groups, block_k) * xs[..., None]).reshape(m, -1)
    ws = jnp.repeat(w_scale.astype(jnp.float32), block_n, axis=0)[:n]  # [N, G]
    w = pad_to(w_fp8.astype(jnp.float32), 1, groups * block_k).reshape(n, groups, block_k)
    w_deq = (w * ws[..., None]).reshape(n, -1)
    out = jnp.dot(x_deq, w_deq.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(jnp_dtype(out_dtype))


FP8_BLOCK_LINEAR.register_jax("xla", fp8_block_linear_xla)
