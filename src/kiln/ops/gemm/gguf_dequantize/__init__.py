"""gguf_dequantize: spec in spec.py, one file per backend beside it (the block decoder the Triton
kernel shares with gguf_linear: ../gguf_triton.py)."""

from kiln.ops.gemm.gguf_dequantize import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.gguf_dequantize.spec import GGUF_DEQUANTIZE, gguf_dequantize

__all__ = ["GGUF_DEQUANTIZE", "gguf_dequantize"]
