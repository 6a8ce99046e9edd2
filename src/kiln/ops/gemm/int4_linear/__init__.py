"""int4_linear: spec in spec.py, one file per backend beside it."""

from kiln.ops.gemm.int4_linear import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.int4_linear.spec import INT4_LINEAR, int4_linear

__all__ = ["INT4_LINEAR", "int4_linear"]
