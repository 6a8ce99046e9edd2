"""silu_and_mul in plain jax.numpy (XLA fuses it): ../gated_pallas.py's XLA version with "silu"."""

from __future__ import annotations

from kiln.ops.activation.gated_pallas import gated_xla
from kiln.ops.activation.silu_and_mul.spec import SILU_AND_MUL


def silu_and_mul_xla(x):
    """x [..., 2*d] -> [..., d]."""
    return gated_xla(x, "silu")


SILU_AND_MUL.register_jax("xla", silu_and_mul_xla)
