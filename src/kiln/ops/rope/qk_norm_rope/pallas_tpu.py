"""qk_norm_rope as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU). See xla.py for the math.

rotary_embedding's TPU kernel (kiln.ops.rope.jax_common) with the norm in front: a program owns a
block of tokens, normalizes each head's [block_tokens, D] tile over D in float32, scales it by the
weight, and rotates it as y * C + (y @ P) * S. One rounding at the end; q and k alias their outputs.
"""

from __future__ import annotations

from kiln.ops.pallas_common import tpu_interpret
from kiln.ops.rope.jax_common import rope_tpu
from kiln.ops.rope.qk_norm_rope.spec import QK_NORM_ROPE


def qk_norm_rope_pallas_tpu(
    positions, q, k, q_weight, k_weight, cos_sin_cache, eps: float = 1e-6, is_neox: bool = True,
    *, interpret=None,
):  # fmt: skip
    """Returns the normalized and rotated (q, k); the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    if q.shape[0] == 0:
        return q, k
    return rope_tpu(
        positions, q, k, cos_sin_cache, q_weight, k_weight, eps=float(eps), is_neox=bool(is_neox),
        interpret=interpret,
    )  # fmt: skip


QK_NORM_ROPE.register_jax("pallas_tpu", qk_norm_rope_pallas_tpu)
