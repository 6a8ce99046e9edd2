"""fp8_linear in plain jax.lax (XLA): the e4m3 operands widened to bfloat16 (exact: 3 mantissa bits
and e4m3's exponent range fit bf16), a float32-accumulated dot, then the scales and the bias in
float32, one rounding to out_dtype. (XLA keeps fp8 dots native where the hardware has them; the
widening keeps one path for every backend, the CPU included.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.ops.gemm.fp8_linear.spec import FP8_LINEAR
from kiln.ops.gemm.jax_codecs import scaled_epilogue

CONTRACT_LAST = (((1,), (1,)), ((), ()))


def fp8_linear_xla(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=jnp.bfloat16):
    x, w = x_fp8.astype(jnp.bfloat16), w_fp8.astype(jnp.bfloat16)
    acc = jax.lax.dot_general(x, w, CONTRACT_LAST, preferred_element_type=jnp.float32)
    return scaled_epilogue(acc, x_scale, w_scale, bias, out_dtype)


FP8_LINEAR.register_jax("xla", fp8_linear_xla)
