"""int8_linear in plain jax.lax (XLA): the int8 x int8 dot with int32 accumulation (exact), then the
per-token and per-channel scales and the bias in float32, one rounding to out_dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.ops.gemm.int8_linear.spec import INT8_LINEAR
from kiln.ops.gemm.jax_codecs import scaled_epilogue

CONTRACT_LAST = (((1,), (1,)), ((), ()))


def int8_linear_xla(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=jnp.bfloat16):
    acc = jax.lax.dot_general(x_int8, w_int8, CONTRACT_LAST, preferred_element_type=jnp.int32)
    return scaled_epilogue(acc.astype(jnp.float32), x_scale, w_scale, bias, out_dtype)


INT8_LINEAR.register_jax("xla", int8_linear_xla)
