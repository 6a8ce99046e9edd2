"""w8a16_linear in plain jax.lax (XLA): the int8 weight widened to x's dtype (exact), the float32
product scaled per output channel, plus the bias, one rounding to x's dtype (../linear/xla.py)."""

from __future__ import annotations

import jax.numpy as jnp

from kiln.ops.gemm.linear.xla import gemm_xla, over_rows
from kiln.ops.gemm.w8a16_linear.spec import W8A16_LINEAR


def flat_scale(weight_scale):
    """[N, 1] or [N] -> float32 [N]."""
    return weight_scale.reshape(-1).astype(jnp.float32)


def w8a16_linear_xla(x, weight, weight_scale, bias=None):
    scale = flat_scale(weight_scale)
    return over_rows(lambda x2: gemm_xla(x2, weight, scale, bias), x, weight.shape[0], bias)


W8A16_LINEAR.register_jax("xla", w8a16_linear_xla)
