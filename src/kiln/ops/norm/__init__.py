"""Normalization ops (RMSNorm, LayerNorm): spec in spec.py, backends beside it."""

from kiln.ops.norm import cpu, triton  # noqa: F401  (registers the implementations)
from kiln.ops.norm.spec import rms_norm

__all__ = ["rms_norm"]
