"""prepared_linear: spec in spec.py, one file per backend beside it; the weight layouts and the
load-time packing it reads are the family's ../weight_formats.py."""

from kiln.ops.gemm.prepared_linear import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.prepared_linear.spec import PREPARED_LINEAR, prepared_linear

__all__ = ["PREPARED_LINEAR", "prepared_linear"]
