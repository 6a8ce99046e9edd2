"""The exact positions of an fp8 KV cache: each sequence's first block and its last `window` positions,
kept unrounded (float16, in the fp8 cache's units) next to the fp8 cache and read from there by the
paged attention ops (paged_decode_attention's contract).

Why: e4m3 rounds every key and value by ~2.5% RMS. On the embedded model that flips greedy tokens
where the top two logits are close, and keeping the first positions (the attention sink) and the most
recent ones exact brings an fp8 cache back to a 16-bit cache's greedy tokens (docs/contracts.md,
"FP8 KV cache"). Every position is still written to the fp8 cache as well, so nothing moves when a
position leaves the window.

Where the exact values live, in a pool of `num_blocks` float16 blocks:
- a ring of `ring_blocks` blocks per running sequence: position j >= block_size goes to ring entry
  (j // block_size) % ring_blocks at offset j % block_size, a circular buffer of ring_blocks *
  block_size positions (two positions share a slot only that far apart). It holds the window plus a
  step's speculative proposals but one, so neither a step's own writes nor rejected proposals (written
  before they are verified) overwrite a position a later window reads.
- one block per fp8 block that starts a sequence: a copy of that first block. It lives as long as the
  fp8 block does, so a prefix-cache hit shares it with the fp8 block; a copy of a block nobody
  references is given up when the pool runs short, and its fp8 block leaves the prefix cache with it
  (`forget_block`), so a later request recomputes that block exactly instead of reading a copy
  rebuilt from rounded values (which would stay rounded for every request sharing it).
A sequence that starts from the prefix cache has its ring filled from the fp8 cache when it is
admitted (`Sequence.exact_fill`): those positions are read as rounded as a plain fp8 cache reads them
until they leave the window.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.engine.sequence import Sequence


@dataclass(frozen=True)
class ExactKVLayout:
    """How many float16 exact blocks the cache has, each sequence's ring size, and the window."""

    num_blocks: int
    ring_blocks: int
    window: int


def exact_kv_layout(
    window: int | None, block_size: int, max_num_seqs: int, num_speculative_tokens: int = 0
) -> ExactKVLayout | None:
    """The layout for an fp8 cache whose sequences keep their first block and last `window` positions
    exact (None: no exact positions). The ring's positions cover the window and all but one of a step's
    speculative proposals: a rejected proposal at position r overwrites r - ring positions, which must
    lie before the next step's window, whose end is at least r - proposals + 2 (its own token after
    none accepted, the step before having written them all). The pool holds every running sequence's
    ring and first block plus as many first blocks again for the prefix cache."""
    if window is None:
        return None
    ring = -(-(window + max(num_speculative_tokens - 1, 0)) // block_size) if window else 0
    return ExactKVLayout(num_blocks=max_num_seqs * (ring + 2), ring_blocks=ring, window=window)


def allocate_exact_caches(
    layout: ExactKVLayout, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact_key_cache, exact_value_cache) float16 [num_blocks, block_size, num_kv_heads, head_dim]
    for one layer, zeros (an unwritten slot must not hold NaN bit patterns)."""
    shape = (layout.num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.zeros(shape, dtype=torch.float16, device=device),
        torch.zeros(shape, dtype=torch.float16, device=device),
    )


class ExactBlockPool:
    """The BlockManager's allocator of exact blocks (see the module docstring).

    first_block_copies: fp8 block id -> the exact block holding its copy; `reclaimable` lists, oldest
    first, the fp8 blocks whose copy may be given up (the fp8 block is cached but unreferenced).
    forget_block: set by the BlockManager; called with an fp8 block whose copy was given up, to take
    that block out of the prefix cache.
    """

    def __init__(self, layout: ExactKVLayout, block_size: int):
        if layout.num_blocks < layout.ring_blocks + 1:
            raise ValueError(
                f"ExactBlockPool: {layout.num_blocks} exact blocks cannot hold one sequence's ring of "
                f"{layout.ring_blocks} and its first block"
            )
        self.layout = layout
        self.block_size = block_size
        self.free_ids: deque[int] = deque(range(layout.num_blocks))
        self.first_block_copies: dict[int, int] = {}
        self.reclaimable: OrderedDict[int, None] = OrderedDict()
        self.forget_block: Callable[[int], None] | None = None

    @property
    def num_available(self) -> int:
        return len(self.free_ids) + len(self.reclaimable)

    def blocks_needed(self, seq: Sequence) -> int:
        """Exact blocks `admit` would take for seq (0 once it has its ring)."""
        if seq.exact_ring is not None:
            return 0
        has_copy = bool(seq.block_table) and seq.block_table[0] in self.first_block_copies
        return self.layout.ring_blocks + (0 if has_copy else 1)

    def _take(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        if self.reclaimable:
            fp8_block, _ = self.reclaimable.popitem(last=False)
            copy = self.first_block_copies.pop(fp8_block)
            if self.forget_block is not None:
                self.forget_block(fp8_block)
            return copy
        raise RuntimeError("ExactBlockPool: out of exact blocks (the scheduler should have preempted)")

    def admit(self, seq: Sequence, first_block_is_new: bool) -> None:
        """Give seq (whose block table now holds its first block) its ring and its first block's copy,
        and queue in seq.exact_fill the (fp8 slot, exact slot) pairs the runner copies before seq's
        first step: for positions served from the prefix cache that the ring (or a missing copy) needs."""
        size, ring_size = self.block_size, self.layout.ring_blocks
        seq.exact_ring = [self._take() for _ in range(ring_size)]
        first = seq.block_table[0]
        computed = seq.num_computed_tokens  # > 0 only after a prefix-cache hit
        fill: list[tuple[int, int]] = []
        copy = self.first_block_copies.get(first)
        if copy is None:
            copy = self.first_block_copies[first] = self._take()
            if not first_block_is_new:  # a hit on a block whose copy is gone: only without forget_block
                fill += [(first * size + p, copy * size + p) for p in range(min(size, computed))]
        seq.exact_first = copy
        if ring_size:
            for p in range(max(size, computed - ring_size * size), computed):
                block = seq.block_table[p // size]
                slot = seq.exact_ring[(p // size) % ring_size] * size + p % size
                fill.append((block * size + p % size, slot))
        seq.exact_fill = fill

    def release(self, seq: Sequence) -> None:
        """Return seq's ring (its first block's copy stays with the fp8 block)."""
        if seq.exact_ring is not None:
            self.free_ids.extend(seq.exact_ring)
        seq.exact_ring, seq.exact_first, seq.exact_fill = None, None, []

    # ---- what the BlockManager reports about fp8 blocks ----
    def block_unreferenced(self, fp8_block: int) -> None:
        """A cached fp8 block lost its last reference: its copy (if any) may be given up."""
        if fp8_block in self.first_block_copies:
            self.reclaimable[fp8_block] = None

    def block_referenced(self, fp8_block: int) -> None:
        """A cached fp8 block is shared again (prefix hit): keep its copy."""
        self.reclaimable.pop(fp8_block, None)

    def block_dropped(self, fp8_block: int) -> None:
        """An fp8 block's content is gone (reused, or freed unnamed): so is its copy's purpose."""
        copy = self.first_block_copies.pop(fp8_block, None)
        if copy is not None:
            self.reclaimable.pop(fp8_block, None)
            self.free_ids.append(copy)


def exact_block_table_row(seq: Sequence) -> list[int]:
    """seq's row of exact_block_tables: its first block's exact block, then its ring."""
    return [seq.exact_first, *seq.exact_ring]


def exact_slots_for(seq: Sequence, start: int, end: int, block_size: int, ring_blocks: int) -> list[int]:
    """The exact slot of each position in [start, end) that seq computes this step (-1: none): the
    first block's positions go to its copy, the last ring_blocks * block_size positions of the step
    to the ring (earlier ones would share ring entries with later ones)."""
    first = seq.exact_first * block_size
    ring_start = end - ring_blocks * block_size
    slots = []
    for p in range(start, end):
        if p < block_size:
            slots.append(first + p)
        elif ring_blocks and p >= ring_start:
            slots.append(seq.exact_ring[(p // block_size) % ring_blocks] * block_size + p % block_size)
        else:
            slots.append(-1)
    return slots


def copy_exact_fill(kv_caches, fill_src: torch.Tensor, fill_dst: torch.Tensor) -> None:
    """Copy fp8 slots fill_src into exact slots fill_dst (int64 [n] each) in every layer of kv_caches
    (LayerKVCache): the fp8 values as float16, already in the exact caches' units."""
    for layer in kv_caches:
        pairs = ((layer.key_cache, layer.exact_key_cache), (layer.value_cache, layer.exact_value_cache))
        for cache, exact in pairs:
            # gathered as bytes: fp8 tensors have no CPU indexing kernel
            rows = cache.view(torch.uint8).view(-1, *cache.shape[2:])[fill_src].view(cache.dtype)
            exact.view(-1, *exact.shape[2:])[fill_dst] = rows.to(torch.float16)
