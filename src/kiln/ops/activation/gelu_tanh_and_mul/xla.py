"""gelu_tanh_and_mul in plain jax.numpy (XLA fuses it): ../gated_pallas.py's XLA version with "gelu_tanh"."""

from __future__ import annotations

from kiln.ops.activation.gated_pallas import gated_xla
from kiln.ops.activation.gelu_tanh_and_mul.spec import GELU_TANH_AND_MUL


def gelu_tanh_and_mul_xla(x):
    """x [..., 2*d] -> [..., d]."""
    return gated_xla(x, "gelu_tanh")


GELU_TANH_AND_MUL.register_jax("xla", gelu_tanh_and_mul_xla)
