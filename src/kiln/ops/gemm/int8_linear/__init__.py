"""int8_linear: spec in spec.py, one file per backend beside it (the Triton kernel is shared with
fp8_linear: ../scaled_triton.py)."""

from kiln.ops.gemm.int8_linear import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.int8_linear.spec import INT8_LINEAR, int8_linear

__all__ = ["INT8_LINEAR", "int8_linear"]
