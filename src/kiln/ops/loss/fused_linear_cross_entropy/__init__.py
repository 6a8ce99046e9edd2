"""fused_linear_cross_entropy: spec (math, reference, shapes) in spec.py, the shared chunk loop in
chunked.py, one file per backend beside them."""

from kiln.ops.loss.fused_linear_cross_entropy import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.loss.fused_linear_cross_entropy.spec import (
    FUSED_LINEAR_CROSS_ENTROPY,
    fused_linear_cross_entropy,
)

__all__ = ["FUSED_LINEAR_CROSS_ENTROPY", "fused_linear_cross_entropy"]
