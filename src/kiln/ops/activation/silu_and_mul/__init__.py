"""silu_and_mul: spec (signature, reference, shapes) in spec.py, one file per backend beside it; the
kernels are shared with the other gated activation (../gated_triton.py, ../gated_pallas.py)."""

from kiln.ops.activation.silu_and_mul import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.activation.silu_and_mul.spec import SILU_AND_MUL, silu_and_mul

__all__ = ["SILU_AND_MUL", "silu_and_mul"]
