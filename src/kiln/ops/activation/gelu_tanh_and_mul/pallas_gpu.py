"""gelu_tanh_and_mul as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU):
the kernel of ../gated_pallas.py with activation "gelu_tanh"."""

from __future__ import annotations

from kiln.ops.activation.gated_pallas import gated_pallas_gpu
from kiln.ops.activation.gelu_tanh_and_mul.spec import GELU_TANH_AND_MUL


def gelu_tanh_and_mul_pallas_gpu(x, *, interpret=None):
    """x [..., 2*d] -> [..., d]; the Pallas Triton kernel (interpreted off-GPU)."""
    return gated_pallas_gpu(x, "gelu_tanh", interpret=interpret)


GELU_TANH_AND_MUL.register_jax("pallas_gpu", gelu_tanh_and_mul_pallas_gpu)
