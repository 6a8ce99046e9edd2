"""quantize_fp8: spec in spec.py, one file per backend beside it (the Triton kernel is shared with
quantize_int8: ../scaled_triton.py)."""

from kiln.ops.gemm.quantize_fp8 import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.quantize_fp8.spec import QUANTIZE_FP8, quantize_fp8

__all__ = ["QUANTIZE_FP8", "quantize_fp8"]
