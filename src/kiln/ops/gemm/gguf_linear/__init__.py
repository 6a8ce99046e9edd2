"""gguf_linear: spec in spec.py, one file per backend beside it (the block decoder the Triton
kernels share with gguf_dequantize: ../gguf_triton.py)."""

from kiln.ops.gemm.gguf_linear import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.gguf_linear.spec import GGUF_LINEAR, gguf_linear

__all__ = ["GGUF_LINEAR", "gguf_linear"]
