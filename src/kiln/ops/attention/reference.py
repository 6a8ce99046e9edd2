"""The float64 definition of attention that every attention op is checked against.

Written as explicit math, one sequence at a time: gather the keys, score, mask, softmax, weighted
sum. Nothing here is fast; it is the reading of docs/contracts.md that the kernels must match.
"""

from __future__ import annotations

import math

import torch


def visible_keys(
    q_len: int, k_len: int, causal: bool, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """bool `[q_len, k_len]`: which keys each query may attend to.

    Queries are the last q_len positions of a k_len-long sequence (bottom-right alignment):
    query i sits at position i + (k_len - q_len); causal lets it see keys j <= that position, a
    sliding window W additionally keeps only keys with position - j < W.
    """
    position = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    j = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible &= j <= position
    if sliding_window is not None:
        visible &= position - j < sliding_window
    return visible


def attend_one_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence, in q's dtype (the verifier passes float64).

    q `[q_len, H, D]`, k and v `[k_len, Hkv, D]` with H a multiple of Hkv (query head h reads kv
    head h // (H // Hkv)). Returns out `[q_len, H, D]` and lse `[H, q_len]` (natural log of the
    softmax denominator of the scaled, soft-capped scores). A query that sees no key gets out = 0
    and lse = -inf.
    """
    q_len, num_heads, head_dim = q.shape
    k_len, num_kv_heads, _ = k.shape
    if k_len == 0:  # no key at all (amax over an empty row would raise)
        lse = torch.full((num_heads, q_len), -math.inf, dtype=q.dtype, device=q.device)
        return torch.zeros(q_len, num_heads, v.shape[-1], dtype=q.dtype, device=q.device), lse
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [k_len, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = visible_keys(q_len, k_len, causal, sliding_window, q.device)
    scores = scores.masked_fill(~visible, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 for hidden keys
    denominator = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    out = torch.einsum("hqk,khd->qhd", probs, v)
    lse = (row_max + torch.log(denominator)).squeeze(-1)  # log(0) = -inf for empty rows
    return out, lse


def gather_paged(
    cache: torch.Tensor,
    block_table_row: torch.Tensor,
    length: int,
    scale: torch.Tensor | None,
    exact: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """The first `length` tokens of one sequence from a paged cache, dequantized.

    cache `[num_blocks, block_size, Hkv, D]`; token t lives in block block_table_row[t // block_size]
    at offset t % block_size. scale `[Hkv]` (fp8 caches store value / scale) or None.
    exact: (exact_cache `[num_exact_blocks, block_size, Hkv, D]`, exact_row `[1 + R]`, window W) of
    an fp8 cache with exact positions (see `exact_positions`): those tokens are read from the exact
    cache instead, before the scale is applied.
    Returns `[length, Hkv, D]` in the cache's dtype (or the scale's when given).
    """
    block_size = cache.shape[1]
    t = torch.arange(length, device=cache.device)
    blocks = block_table_row.long()[t // block_size]
    tokens = cache[blocks, t % block_size]
    if exact is not None:
        exact_cache, exact_row, window = exact
        tokens = tokens.to(exact_cache.dtype)
        for position in exact_positions(length, block_size, window):
            block, offset = exact_slot(exact_row.tolist(), position, block_size)
            tokens[position] = exact_cache[block, offset]
    if scale is not None:
        tokens = tokens.to(scale.dtype) * scale[None, :, None]
    return tokens


def exact_positions(length: int, block_size: int, window: int) -> list[int]:
    """The positions of a `length`-long context an fp8 cache with exact positions reads from its
    exact caches: the first block (positions < block_size) and the last `window` positions."""
    return [j for j in range(length) if j < block_size or j >= length - window]


def exact_slot(exact_row: list[int], position: int, block_size: int) -> tuple[int, int]:
    """(block, offset) of `position` in the exact caches: the first block's positions in block
    exact_row[0], every later one in the ring exact_row[1:], at entry (position // block_size) % R."""
    if position < block_size:
        return exact_row[0], position
    ring = exact_row[1:]
    return ring[(position // block_size) % len(ring)], position % block_size
