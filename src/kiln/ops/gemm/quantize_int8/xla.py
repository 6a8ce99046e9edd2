"""quantize_int8 in jax.numpy (XLA): per-row amax, scale = max(amax, 1e-12) / 127, x / scale rounded
half away from zero (as the spec's reference and the Triton kernel), all in float32 (both divisions
rounded once: div_rn)."""

from __future__ import annotations

import jax.numpy as jnp

from kiln.ops.gemm.quantize_int8.spec import QUANTIZE_INT8
from kiln.ops.gemm.scaled import AMAX_FLOOR, INT8_MAX
from kiln.ops.jax_div_rn import div_rn


def round_half_away(v):
    """C's roundf (ties away from zero); without jnp.sign, which Mosaic lowers only for a known TPU."""
    magnitude = jnp.floor(jnp.abs(v) + 0.5)
    return jnp.where(v < 0, -magnitude, magnitude)


def quantize_int8_xla(x):
    xf = x.astype(jnp.float32)
    scale = div_rn(jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), AMAX_FLOOR), INT8_MAX)
    q = jnp.clip(round_half_away(div_rn(xf, scale)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


QUANTIZE_INT8.register_jax("xla", quantize_int8_xla)
