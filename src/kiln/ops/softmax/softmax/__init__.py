"""softmax: spec (signature, reference, shapes) in spec.py, one file per backend beside it."""

from kiln.ops.softmax.softmax import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.softmax.softmax.spec import SOFTMAX, softmax

__all__ = ["SOFTMAX", "softmax"]
