"""layer_norm: spec (signature, reference, shapes) in spec.py, one file per backend beside it."""

from kiln.ops.norm.layer_norm import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.norm.layer_norm.spec import LAYER_NORM, layer_norm

__all__ = ["LAYER_NORM", "layer_norm"]
