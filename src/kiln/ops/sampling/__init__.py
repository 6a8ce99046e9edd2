"""Sampling ops: rejection_sample (speculative decoding's verify step: accept proposals by the
probability ratio, draw the last token from the residual)."""

from kiln.ops.sampling.rejection_sample import rejection_sample

__all__ = ["rejection_sample"]
