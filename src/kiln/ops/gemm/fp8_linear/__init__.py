"""fp8_linear: spec in spec.py, one file per backend beside it (the Triton kernel is shared with
int8_linear: ../scaled_triton.py)."""

from kiln.ops.gemm.fp8_linear import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.fp8_linear.spec import FP8_LINEAR, fp8_linear

__all__ = ["FP8_LINEAR", "fp8_linear"]
