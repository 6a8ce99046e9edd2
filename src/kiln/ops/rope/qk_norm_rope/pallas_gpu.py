"""qk_norm_rope as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU): the rope GPU
kernel (kiln.ops.rope.gpu_kernel) with the RMS norm in front. See xla.py for the math."""

from __future__ import annotations

from kiln.ops.pallas_common import gpu_interpret
from kiln.ops.rope.gpu_kernel import rope_gpu
from kiln.ops.rope.qk_norm_rope.spec import QK_NORM_ROPE


def qk_norm_rope_pallas_gpu(
    positions, q, k, q_weight, k_weight, cos_sin_cache, eps: float = 1e-6, is_neox: bool = True,
    *, interpret=None,
):  # fmt: skip
    """Returns the normalized and rotated (q, k); the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    if q.shape[0] == 0:
        return q, k
    return rope_gpu(
        positions, q, k, cos_sin_cache, q_weight, k_weight, eps=float(eps), is_neox=bool(is_neox),
        interpret=interpret,
    )  # fmt: skip


QK_NORM_ROPE.register_jax("pallas_gpu", qk_norm_rope_pallas_gpu)
