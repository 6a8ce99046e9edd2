"""Gated activations (SiLU and tanh-GELU times up): one folder per op (spec + backends); gated.py,
gated_triton.py and gated_pallas.py hold what the two share."""

from kiln.ops.activation.gelu_tanh_and_mul import gelu_tanh_and_mul
from kiln.ops.activation.silu_and_mul import silu_and_mul

__all__ = ["gelu_tanh_and_mul", "silu_and_mul"]
