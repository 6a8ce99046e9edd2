"""PyTorch versions of the kiln.ops the model layers call, with the kiln.ops contract signatures.

The layers resolve each op with `op(name)`: `kiln.ops.<name>` when that family has landed, else the
version here, so the model runs (and is checked against HF) whatever the state of the op families.
These are plain, vectorized torch (SDPA for attention), good CPU paths in their own right.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import kiln.ops


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float = 10000.0,
    scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """[max_position, rotary_dim]: cos of the rotary_dim // 2 frequencies, then their sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    positions = torch.arange(max_position, dtype=torch.float64)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        positions = positions / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    elif rope_type != "default":
        raise ValueError(
            f"rope_cos_sin_cache: scaling rope_type {rope_type!r} is not supported (linear, llama3)"
        )
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency remap: long wavelengths slowed by `factor`, short ones kept, a smooth
    interpolation between the low/high-frequency wavelength bounds."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen) - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, interpolated)
    return torch.where(wavelen < old_len / high, inv_freq, out)


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
    """Rotates the first rotary_dim dims of q [T, Hq, D] and k [T, Hk, D] in place (NeoX half-split)."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # [T, rotary_dim / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        rot = x[..., :rotary_dim]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        if is_neox:
            rot.copy_(torch.cat([r1, r2], dim=-1))
        else:
            rot.copy_(torch.stack([r1, r2], dim=-1).flatten(-2))
    return q, k


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def _gather(cache, block_table, seq_len):
    """[seq_len, Hkv, D]: one sequence's keys or values, in order."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def _attend(q, k, v, q_len, k_len, scale, sliding_window):
    """q [q_len, H, D] against k, v [k_len, Hkv, D]; bottom-right causal (+ window)."""
    mask = None
    if q_len > 1 or sliding_window is not None:
        i = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        j = torch.arange(k_len, device=q.device)[None, :]
        mask = j <= i
        if sliding_window is not None:
            mask &= (i - j) < sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).to(q.dtype),
        v.transpose(0, 1).to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def paged_prefill_attention(
    q,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    max_seqlen_q,
    scale=None,
    sliding_window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
):
    if softcap is not None or k_scale is not None:
        raise ValueError("paged_prefill_attention (torch fallback): softcap and fp8 caches are not supported")
    out = torch.empty_like(q)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s, k_len in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        k = _gather(key_cache, block_tables[s], k_len)
        v = _gather(value_cache, block_tables[s], k_len)
        out[a:b] = _attend(q[a:b], k, v, b - a, k_len, scale, sliding_window)
    return out


def paged_decode_attention(
    q,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    scale=None,
    sliding_window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
):
    num_seqs = q.shape[0]
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    return paged_prefill_attention(
        q,
        key_cache,
        value_cache,
        block_tables,
        cu,
        seq_lens,
        1,
        scale,
        sliding_window,
        softcap,
        k_scale,
        v_scale,
    )


def op(name: str, device: torch.device | None = None) -> Callable[..., Any]:
    """The function a layer calls for op `name`: `kiln.ops.<name>` when that op exists, else the torch
    version above.

    On the CPU the registry's selected implementation is returned directly: the public function would
    re-validate the same model-built shapes on every call, about a third of a decode step's Python
    time for a small model. Elsewhere the public function (custom op, validation) is kept.
    """
    public = getattr(kiln.ops, name, None)
    if public is None:
        return globals()[name]
    if device is not None and device.type == "cpu":
        try:
            return kiln.ops.get_op(name).select(device).fn
        except ValueError:
            return public  # not a registered op (a plain helper like rope_cos_sin_cache)
    return public
