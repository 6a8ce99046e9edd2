"""BlockManager: the KV-cache block allocator, with reference counts and prefix caching.

The cache is `num_blocks` blocks of `block_size` token slots (slot = block * block_size + offset).
A sequence owns a block table; block i of it holds the KV of positions [i * block_size, (i+1) * block_size).

Prefix caching: once a block is full and its KV computed, it is named by a hash chained through
its predecessors, a 128-bit digest of (parent hash, token ids of the block), so equal hashes mean
equal whole prefixes. A new request walks its prompt's full blocks through that map and shares every block
that matches (ref_count + 1), computing only the rest. Blocks whose ref_count drops to 0 keep
their content and stay findable until the allocator needs them: they are evicted in LRU order,
plain never-cached free blocks being used first.

An fp8 cache with exact positions has a second pool, of float16 exact blocks (`exact`,
kiln.engine.exact_kv.ExactBlockPool): a sequence gets its ring and its first block's copy with its
first blocks, and gives the ring back when it is freed; the copy follows its fp8 block's life, and
an unreferenced block whose copy the exact pool gives up leaves the prefix cache (`_forget`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from kiln.engine.exact_kv import ExactBlockPool
from kiln.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # checked on a hit, so a hash collision can't alias


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: depends on every token of the prefix it ends. A 128-bit BLAKE2b
    digest: with Python's hash() a hit checked the block's own tokens but not the chain before it, and
    hash((p, c)) == hash((p + 2**61 - 1, c)), so crafted prompts could share another's KV."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update((parent_hash or 0).to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        exact: ExactBlockPool | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"BlockManager: num_blocks={num_blocks}, expected >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # free and holding nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached; oldest first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.exact = exact
        if exact is not None:
            exact.forget_block = self._forget

    # ---- counts ----
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers the next num_new_tokens positions of seq."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if self.exact is not None and self.exact.blocks_needed(seq) > self.exact.num_available:
            return False
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    # ---- allocation ----
    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)  # least recently released
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
            block.token_ids = None
        else:
            raise RuntimeError("BlockManager: out of KV blocks (the scheduler should have preempted)")
        if self.exact is not None:
            self.exact.block_dropped(block_id)
        self.blocks[block_id].ref_count = 1
        return block_id

    def _forget(self, block_id: int) -> None:
        """Take an unreferenced cached block out of the prefix cache (its exact first-block copy was
        given up): it becomes a plain free block, and the blocks chained after it can no longer match."""
        block = self.blocks[block_id]
        if block.ref_count == 0 and block_id in self.evictable:
            del self.evictable[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
            block.token_ids = None
            self.free_block_ids.append(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None  # most recently released goes last
                if self.exact is not None:
                    self.exact.block_unreferenced(block_id)
            else:
                self.free_block_ids.append(block_id)
                if self.exact is not None:
                    self.exact.block_dropped(block_id)

    def match_prefix(self, seq: Sequence) -> int:
        """At admission (empty block table): share the cached blocks of seq's longest cached prefix.

        Only blocks that end before the last token are candidates, so at least the last token is
        always computed (its logits give the next token). A sequence still owed prompt logprobs
        matches nothing: cached tokens have no logits. Sets seq.num_computed_tokens and, at a
        first admission, seq.num_cached_tokens and the prompt lookup counters (a preempted sequence's
        re-admission looks up its output too: not a prompt served from the cache); returns the
        number of tokens reused.
        """
        assert not seq.block_table, "match_prefix on a sequence that already holds blocks"
        if not self.enable_prefix_caching or seq.prompt_logprobs_pending:  # no logits for cached tokens
            return 0
        size = self.block_size
        tokens = seq.token_ids
        parent = None
        for i in range((len(tokens) - 1) // size):
            chunk = tuple(tokens[i * size : (i + 1) * size])
            h = block_hash(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
                if self.exact is not None:
                    self.exact.block_referenced(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        reused = len(seq.block_table) * size
        seq.num_computed_tokens = reused
        if not seq.preempted:
            self.prefix_cache_queries += len(tokens)
            self.prefix_cache_hits += reused
            seq.num_cached_tokens = reused
        return reused

    def unmatch_prefix(self, seq: Sequence) -> None:
        """Undo match_prefix for a request that could not be admitted after all (counters included)."""
        if self.enable_prefix_caching and not seq.preempted and not seq.prompt_logprobs_pending:
            self.prefix_cache_queries -= len(seq.token_ids)
            self.prefix_cache_hits -= seq.num_computed_tokens
            seq.num_cached_tokens = 0
        self.free(seq)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to cover its next num_new_tokens positions (check can_allocate first);
        with exact positions, a sequence's first allocation also gives it its exact blocks."""
        first_block_is_new = not seq.block_table
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())
        if self.exact is not None and seq.exact_ring is None and seq.block_table:
            self.exact.admit(seq, first_block_is_new)

    def trim(self, seq: Sequence, num_positions: int) -> None:
        """Release the blocks of seq's table past the first num_positions positions (speculative
        tokens that were rejected: their KV is garbage and their blocks were never named)."""
        keep = -(-num_positions // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        del seq.block_hashes[keep:]

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a step: name every newly completed full block of seq so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        num_full = seq.num_computed_tokens // size
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            chunk = tuple(seq.token_ids[i * size : (i + 1) * size])
            h = block_hash(parent, chunk)
            block = self.blocks[seq.block_table[i]]
            # a block computed twice (two requests prefilling the same prefix at once) stays unnamed:
            # the first copy serves later hits, this one returns to the plain free list when released
            if block.hash is None and h not in self.hash_to_block:
                block.hash = h
                block.token_ids = chunk
                self.hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)

    def free(self, seq: Sequence) -> None:
        """Drop seq's blocks (its KV is gone: num_computed_tokens = 0). Tail blocks are released
        first so they are evicted before the prefix blocks more requests are likely to share."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        if self.exact is not None:
            self.exact.release(seq)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
