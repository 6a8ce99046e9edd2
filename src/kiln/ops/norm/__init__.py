"""Normalization ops (RMSNorm, LayerNorm): spec in spec.py, backends beside it."""

from kiln.ops.norm import cpu, triton  # noqa: F401  (registers the implementations)
from kiln.ops.norm.spec import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
