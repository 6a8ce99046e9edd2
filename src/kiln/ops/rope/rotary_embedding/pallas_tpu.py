"""rotary_embedding as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU). See xla.py for
the layouts and the pair conventions, kiln.ops.rope.jax_common for the kernel (rotate(x) as x @ P,
one exact MXU matmul per head; the per-token cos/sin rows gathered by XLA in the wrapper).
"""

from __future__ import annotations

from kiln.ops.pallas_common import tpu_interpret
from kiln.ops.rope.jax_common import rope_tpu
from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING


def rotary_embedding_pallas_tpu(positions, q, k, cos_sin_cache, is_neox: bool = True, *, interpret=None):
    """Returns the rotated (q, k); the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    if q.shape[0] == 0:
        return q, k
    return rope_tpu(
        positions, q, k, cos_sin_cache, None, None, eps=None, is_neox=bool(is_neox), interpret=interpret
    )


ROTARY_EMBEDDING.register_jax("pallas_tpu", rotary_embedding_pallas_tpu)
