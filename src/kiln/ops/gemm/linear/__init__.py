"""linear: spec (signature, reference, shapes) in spec.py, one file per backend beside it
(triton.py: the pointer kernel and the dispatch; triton_tma.py: the Hopper TMA kernel)."""

from kiln.ops.gemm.linear import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.gemm.linear.spec import LINEAR, linear

__all__ = ["LINEAR", "linear"]
