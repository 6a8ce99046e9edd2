"""Gated activations (SiLU and tanh-GELU times up): spec in spec.py, backends beside it."""

from kiln.ops.activation import cpu, triton  # noqa: F401  (registers the implementations)
from kiln.ops.activation.spec import gelu_tanh_and_mul, silu_and_mul

__all__ = ["gelu_tanh_and_mul", "silu_and_mul"]
