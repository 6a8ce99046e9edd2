"""quantize_fp8 in jax.numpy (XLA): amax over the row (or the whole tensor), scale = max(amax, 1e-12)
/ 448, x / scale clamped and rounded to e4m3 (nearest even), all in float32 (both divisions rounded
once: div_rn)."""

from __future__ import annotations

import jax.numpy as jnp

from kiln.ops.gemm.quantize_fp8.spec import QUANTIZE_FP8
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_MAX
from kiln.ops.jax_div_rn import div_rn


def quantize_fp8_xla(x, per_token=True):
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) if per_token else jnp.max(jnp.abs(xf)).reshape(1)
    scale = div_rn(jnp.maximum(amax, AMAX_FLOOR), FP8_MAX)
    q = jnp.clip(div_rn(xf, scale.reshape(-1, 1)), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


QUANTIZE_FP8.register_jax("xla", quantize_fp8_xla)
