"""int4_linear in jax.numpy (XLA): the packed nibbles unpacked and dequantized in float32 (../jax_codecs.py),
rounded to x's dtype, then linear's float32-accumulated GEMM (../linear/xla.py)."""

from __future__ import annotations

from kiln.ops.gemm.int4_linear.spec import INT4_LINEAR
from kiln.ops.gemm.jax_codecs import dequantize_int4
from kiln.ops.gemm.linear.xla import gemm_xla, over_rows


def int4_linear_xla(x, qweight, scales, zeros, group_size):
    w = dequantize_int4(qweight, scales, zeros, group_size, x.shape[-1]).astype(x.dtype)
    return over_rows(lambda x2: gemm_xla(x2, w), x, qweight.shape[0], None)


INT4_LINEAR.register_jax("xla", int4_linear_xla)
