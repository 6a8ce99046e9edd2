"""rotary_embedding as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU): the rope GPU
kernel (kiln.ops.rope.gpu_kernel) without the norm. See xla.py for the layouts and pair conventions."""

from __future__ import annotations

from kiln.ops.pallas_common import gpu_interpret
from kiln.ops.rope.gpu_kernel import rope_gpu
from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING


def rotary_embedding_pallas_gpu(positions, q, k, cos_sin_cache, is_neox: bool = True, *, interpret=None):
    """Returns the rotated (q, k); the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    if q.shape[0] == 0:
        return q, k
    return rope_gpu(
        positions, q, k, cos_sin_cache, None, None, eps=0.0, is_neox=bool(is_neox), interpret=interpret
    )


ROTARY_EMBEDDING.register_jax("pallas_gpu", rotary_embedding_pallas_gpu)
