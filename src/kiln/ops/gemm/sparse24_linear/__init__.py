"""sparse24_linear: spec in spec.py, one file per backend beside it."""

from kiln.ops.gemm.sparse24_linear import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.sparse24_linear.spec import SPARSE24_LINEAR, sparse24_linear

__all__ = ["SPARSE24_LINEAR", "sparse24_linear"]
