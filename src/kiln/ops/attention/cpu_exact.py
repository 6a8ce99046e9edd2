"""The exact positions of an fp8 KV cache on the CPU paths of both paged attention ops: the keys or
values they gathered from the fp8 cache get the exact caches' values at the positions the contract
reads from there (paged_decode_attention/spec.py): each sequence's first block and its last
exact_window positions. One index computation and one masked copy per gathered tensor.
"""

from __future__ import annotations

import torch


def exact_slots(
    exact_block_tables: torch.Tensor, seq_lens: torch.Tensor, width: int, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask bool [N, width], slots int64 [N, width]): which of the first `width` positions of each of
    N sequences (exact_block_tables int32 [N, 1 + R], seq_lens [N]) are exact, and where they sit in
    the exact caches flattened to [num_exact_blocks * block_size, ...] (meaningful where mask is)."""
    positions = torch.arange(width, device=seq_lens.device)[None, :]
    lens = seq_lens.long()[:, None]
    first_block = positions < block_size
    mask = (first_block | (positions >= lens - window)) & (positions < lens)
    tables = exact_block_tables.long()
    ring = tables.shape[1] - 1
    blocks = tables[:, :1].expand(-1, width)
    if ring:
        ring_column = 1 + (positions // block_size) % ring
        blocks = torch.where(first_block, blocks, tables.gather(1, ring_column.expand(tables.shape[0], -1)))
    return mask, blocks * block_size + positions % block_size


def overlay_exact(
    tokens: torch.Tensor,
    exact_cache: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """tokens [N, L, Hkv, D] (fp8 values gathered, not yet scaled) with the exact positions (mask,
    slots from exact_slots, [N, L]) replaced by exact_cache's [num_exact_blocks, block_size, Hkv, D]
    values; in place when tokens is already a float tensor, else a float32 copy. Returns it."""
    if not tokens.is_floating_point() or tokens.element_size() == 1:
        tokens = tokens.float()
    flat = exact_cache.reshape(-1, *exact_cache.shape[2:])
    tokens[mask] = flat[slots[mask]].to(tokens.dtype)
    return tokens
