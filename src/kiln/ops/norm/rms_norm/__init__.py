"""rms_norm: spec (signature, reference, shapes) in spec.py, one file per backend beside it."""

from kiln.ops.norm.rms_norm import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.norm.rms_norm.spec import RMS_NORM, rms_norm

__all__ = ["RMS_NORM", "rms_norm"]
