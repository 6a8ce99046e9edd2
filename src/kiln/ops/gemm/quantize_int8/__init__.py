"""quantize_int8: spec in spec.py, one file per backend beside it (the Triton kernel is shared with
quantize_fp8: ../scaled_triton.py)."""

from kiln.ops.gemm.quantize_int8 import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.quantize_int8.spec import QUANTIZE_INT8, quantize_int8

__all__ = ["QUANTIZE_INT8", "quantize_int8"]
