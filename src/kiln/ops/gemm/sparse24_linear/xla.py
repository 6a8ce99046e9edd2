"""sparse24_linear in jax.numpy (XLA): the 2:4 weight expanded to dense [N, K] (exact, ../jax_codecs.py),
then linear's float32-accumulated GEMM with the bias epilogue (../linear/xla.py)."""

from __future__ import annotations

from kiln.ops.gemm.jax_codecs import decompress_24
from kiln.ops.gemm.linear.xla import gemm_xla, over_rows
from kiln.ops.gemm.sparse24_linear.spec import SPARSE24_LINEAR


def sparse24_linear_xla(x, values, meta, bias=None):
    w = decompress_24(values, meta)
    return over_rows(lambda x2: gemm_xla(x2, w, None, bias), x, values.shape[0], bias)


SPARSE24_LINEAR.register_jax("xla", sparse24_linear_xla)
