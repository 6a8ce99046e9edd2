"""Softmax over the last dim (with temperature): softmax/ holds its spec and one file per backend."""

from kiln.ops.softmax.softmax import softmax

__all__ = ["softmax"]
