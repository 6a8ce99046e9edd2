"""Fast CPU path for rotary embedding: one gather of the cos/sin rows, then vectorized PyTorch
arithmetic on strided views of q and k, written back in place."""

from __future__ import annotations

from kiln.ops.registry import Implementation, cpu_only
from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING


def _rotate_(x, cos, sin, is_neox):
    rotary_dim = 2 * cos.shape[-1]
    if is_neox:
        x1, x2 = x[..., : rotary_dim // 2], x[..., rotary_dim // 2 : rotary_dim]
    else:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    # float32 input: f1, f2 are the views themselves; halves: float32 copies. Either way x1' is built
    # in a new buffer before anything is written, then x2' in place in f2 (which still reads the
    # original x1 through f1), and both are written back (a no-op copy for the float32 views).
    f1, f2 = x1.float(), x2.float()
    out1 = (f1 * cos).addcmul_(f2, sin, value=-1.0)
    f2.mul_(cos).addcmul_(f1, sin)
    x1.copy_(out1)
    x2.copy_(f2)


def rotary_embedding_cpu(positions, q, k, cos_sin_cache, is_neox=True):
    cos_sin = cos_sin_cache.index_select(0, positions).float()  # [T, rotary_dim]
    cos, sin = cos_sin[:, None, : cos_sin.shape[-1] // 2], cos_sin[:, None, cos_sin.shape[-1] // 2 :]
    _rotate_(q, cos, sin, is_neox)
    _rotate_(k, cos, sin, is_neox)
    return q, k


ROTARY_EMBEDDING.register(Implementation("cpu", rotary_embedding_cpu, cpu_only))
