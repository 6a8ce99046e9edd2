"""gguf_linear in jax.numpy (XLA): the blocks decoded in float32 (../jax_codecs.py), rounded to x's
dtype, then linear's float32-accumulated GEMM with the bias epilogue (../linear/xla.py)."""

from __future__ import annotations

from kiln.ops.gemm.gguf_linear.spec import GGUF_LINEAR
from kiln.ops.gemm.jax_codecs import dequantize_gguf
from kiln.ops.gemm.linear.xla import gemm_xla, over_rows


def gguf_linear_xla(x, qweight, qtype, bias=None):
    w = dequantize_gguf(qweight, qtype).astype(x.dtype)
    return over_rows(lambda x2: gemm_xla(x2, w, None, bias), x, qweight.shape[0], bias)


GGUF_LINEAR.register_jax("xla", gguf_linear_xla)
