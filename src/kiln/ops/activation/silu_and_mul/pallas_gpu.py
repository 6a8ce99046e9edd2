"""silu_and_mul as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU):
the kernel of ../gated_pallas.py with activation "silu"."""

from __future__ import annotations

from kiln.ops.activation.gated_pallas import gated_pallas_gpu
from kiln.ops.activation.silu_and_mul.spec import SILU_AND_MUL


def silu_and_mul_pallas_gpu(x, *, interpret=None):
    """x [..., 2*d] -> [..., d]; the Pallas Triton kernel (interpreted off-GPU)."""
    return gated_pallas_gpu(x, "silu", interpret=interpret)


SILU_AND_MUL.register_jax("pallas_gpu", silu_and_mul_pallas_gpu)
