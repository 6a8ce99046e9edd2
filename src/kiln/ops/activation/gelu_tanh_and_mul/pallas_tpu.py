"""gelu_tanh_and_mul as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU):
the kernel of ../gated_pallas.py with activation "gelu_tanh"."""

from __future__ import annotations

from kiln.ops.activation.gated_pallas import gated_pallas_tpu
from kiln.ops.activation.gelu_tanh_and_mul.spec import GELU_TANH_AND_MUL


def gelu_tanh_and_mul_pallas_tpu(x, *, interpret=None):
    """x [..., 2*d] -> [..., d]; the Mosaic TPU kernel (interpreted off-TPU)."""
    return gated_pallas_tpu(x, "gelu_tanh", interpret=interpret)


GELU_TANH_AND_MUL.register_jax("pallas_tpu", gelu_tanh_and_mul_pallas_tpu)
