"""linear_silu_mul: spec in spec.py, one file per backend beside it (the Triton kernels are linear's,
with the SiLU-and-mul epilogue: ../linear/triton.py and ../linear/triton_tma.py)."""

from kiln.ops.gemm.linear_silu_mul import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.linear_silu_mul.spec import LINEAR_SILU_MUL, linear_silu_mul

__all__ = ["LINEAR_SILU_MUL", "linear_silu_mul"]
