"""Training losses: fused_linear_cross_entropy/ (the LM head and cross-entropy, chunked, with their
gradients) holds its spec and one file per backend."""

from kiln.ops.loss.fused_linear_cross_entropy import fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy"]
