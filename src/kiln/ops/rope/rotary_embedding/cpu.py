"""Fast CPU path for rotary embedding: float32 q, k and cache through Kiln's native kernel
(rotary_embedding_cpu.cpp, one call, in place); otherwise one gather of the cos/sin rows, then vectorized
PyTorch arithmetic on strided views of q and k, written back in place. Traced by torch.compile (the
compiled CPU decode step), the rotated heads are built as new tensors by `_rotary_in_graph`."""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
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


def _rotated(x, cos, sin, is_neox):
    """x [T, H, D] -> a new tensor of x's dtype, its first 2 * r dims rotated (cos, sin float32 [T, r]).
    Each pair (x1, x2) becomes x * cos + swap(x) * (-sin, sin): the swap is a flip of a size-2 dim,
    which inductor indexes directly (no masked halves)."""
    tokens, heads, head_dim = x.shape
    r = cos.shape[-1]
    xf = x[..., : 2 * r].float()
    if is_neox:  # pairs (i, i + r)
        pairs, c, s, dim = xf.view(tokens, heads, 2, r), cos[:, None, None, :], torch.stack([-sin, sin], 1), 2
    else:  # pairs (2i, 2i + 1)
        pairs, c, s, dim = xf.view(tokens, heads, r, 2), cos[:, None, :, None], torch.stack([-sin, sin], 2), 3
    out = (pairs * c + pairs.flip(dim) * s[:, None]).view(tokens, heads, 2 * r).to(x.dtype)
    return out if 2 * r == head_dim else torch.cat([out, x[..., 2 * r :]], -1)


def _rotary_in_graph(positions, q, k, cos_sin_cache, is_neox):
    """The rotation as a compiled graph holds it: q and k are still written in place, but the new
    tensors are returned, so the graph's later reads of the heads (attention, the KV write) read them
    and not q and k, views into the fused QKV buffer whose in-place updates inductor re-reads through
    masked index arithmetic (SmolLM2, 2 threads, RoPE + KV write + attention of one layer at batch 1:
    ~168 -> ~155 us a call)."""
    cos_sin = cos_sin_cache.index_select(0, positions).float()
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    q_new, k_new = _rotated(q, cos, sin, is_neox), _rotated(k, cos, sin, is_neox)
    q.copy_(q_new)
    k.copy_(k_new)
    return q_new, k_new


def rotary_embedding_cpu(positions, q, k, cos_sin_cache, is_neox=True):
    if torch.compiler.is_compiling():
        return _rotary_in_graph(positions, q, k, cos_sin_cache, is_neox)
    if (
        q.dtype == k.dtype == cos_sin_cache.dtype == torch.float32
        and q.dim() == k.dim() == 3
        and native_cpu.load()
    ):
        torch.ops.kiln_cpu.rotary_embedding_(positions.long(), q, k, cos_sin_cache, is_neox)
        return q, k
    cos_sin = cos_sin_cache.index_select(0, positions).float()  # [T, rotary_dim]
    cos, sin = cos_sin[:, None, : cos_sin.shape[-1] // 2], cos_sin[:, None, cos_sin.shape[-1] // 2 :]
    _rotate_(q, cos, sin, is_neox)
    _rotate_(k, cos, sin, is_neox)
    return q, k


ROTARY_EMBEDDING.register(Implementation("cpu", rotary_embedding_cpu, cpu_only))
