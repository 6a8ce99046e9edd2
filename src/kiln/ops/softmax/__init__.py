"""Softmax over the last dim (with temperature): spec in spec.py, backends beside it."""

from kiln.ops.softmax import cpu, triton  # noqa: F401  (registers the implementations)
from kiln.ops.softmax.spec import softmax

__all__ = ["softmax"]
