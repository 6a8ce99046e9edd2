"""Normalization ops: rms_norm (optionally fused with the residual add) and layer_norm."""

from kiln.ops.norm.layer_norm import layer_norm
from kiln.ops.norm.rms_norm import rms_norm

__all__ = ["layer_norm", "rms_norm"]
