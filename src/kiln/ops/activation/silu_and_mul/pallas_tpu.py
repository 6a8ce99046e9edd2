"""silu_and_mul as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU):
the kernel of ../gated_pallas.py with activation "silu"."""

from __future__ import annotations

from kiln.ops.activation.gated_pallas import gated_pallas_tpu
from kiln.ops.activation.silu_and_mul.spec import SILU_AND_MUL


def silu_and_mul_pallas_tpu(x, *, interpret=None):
    """x [..., 2*d] -> [..., d]; the Mosaic TPU kernel (interpreted off-TPU)."""
    return gated_pallas_tpu(x, "silu", interpret=interpret)


SILU_AND_MUL.register_jax("pallas_tpu", silu_and_mul_pallas_tpu)
