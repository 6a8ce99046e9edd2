"""fp8_block_linear: spec in spec.py, one file per backend beside it."""

from kiln.ops.gemm.fp8_block_linear import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.fp8_block_linear.spec import FP8_BLOCK_LINEAR, fp8_block_linear

__all__ = ["FP8_BLOCK_LINEAR", "fp8_block_linear"]
