"""BlockManager: allocation, reference counts, the prefix hash chain, LRU eviction, running out."""

import pytest

from kiln.engine.block_manager import BlockManager, block_hash
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Sequence


def make_seq(tokens, name="r"):
    return Sequence(name, list(tokens), SamplingParams())


def admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a whole prompt in one step: match, allocate, compute, register."""
    reused = bm.match_prefix(seq)
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)
    return reused


def test_allocate_then_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = make_seq(range(10, 21))  # 11 tokens -> 3 blocks
    bm.allocate(seq, seq.num_tokens)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_used_blocks == 3
    bm.free(seq)
    assert bm.num_used_blocks == 0 and seq.block_table == [] and seq.num_computed_tokens == 0


def test_allocate_grows_table_only_when_a_block_fills():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(4))
    bm.allocate(seq, 4)
    seq.num_computed_tokens = 4
    assert bm.blocks_needed(seq, 1) == 1  # position 4 starts a new block
    bm.allocate(seq, 1)
    seq.num_computed_tokens = 5
    assert bm.blocks_needed(seq, 1) == 0 and len(seq.block_table) == 2


def test_shared_prefix_blocks_are_reused_and_refcounted():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(100, 110)), "a")  # 2 full blocks + 2 tokens
    assert admit(bm, a) == 0
    b = make_seq(list(range(100, 108)) + [7, 7, 7], "b")  # same first 2 blocks
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 10 + 11
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_hash_chain_does_not_match_same_block_after_a_different_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    other = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 9], "b")  # block 2 equal, block 1 not
    assert admit(bm, other) == 0


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit(bm, make_seq(range(8), "a"))  # exactly 2 full blocks, both registered
    again = make_seq(range(8), "b")
    assert bm.match_prefix(again) == 4  # the block holding the last token is recomputed
    assert again.num_uncomputed_tokens == 4
    longer = make_seq(range(9), "c")
    assert bm.match_prefix(longer) == 8 and longer.num_uncomputed_tokens == 1


def test_released_cached_blocks_are_still_hits_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(9), "a")
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_seq(range(9), "b")
    assert admit(bm, b) == 8


def test_eviction_takes_plain_free_blocks_first_then_least_recently_released():
    bm = BlockManager(num_blocks=4, block_size=2)
    old = make_seq([1, 2, 3], "old")  # registers 1 full block
    admit(bm, old)
    bm.free(old)
    new = make_seq([5, 6, 7], "new")
    admit(bm, new)
    bm.free(new)  # now: 2 cached free blocks (old released first), 2 plain free blocks
    filler = make_seq([8], "f")
    bm.allocate(filler, 6)  # 3 blocks: the 2 plain ones, then evicts exactly "old" (released first)
    bm.free(filler)
    assert bm.match_prefix(make_seq([5, 6, 7])) == 2
    assert bm.match_prefix(make_seq([1, 2, 3])) == 0


def test_out_of_blocks_is_reported_by_can_allocate_and_raises_on_allocate():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = make_seq(range(8), "a")
    assert bm.can_allocate(a, 8)
    bm.allocate(a, 8)
    b = make_seq(range(3), "b")
    assert not bm.can_allocate(b, 3)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 3)


def test_unmatch_prefix_restores_counters_and_refcounts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(9), "a")
    admit(bm, a)
    hits, queries = bm.prefix_cache_hits, bm.prefix_cache_queries
    b = make_seq(range(9), "b")
    bm.match_prefix(b)
    bm.unmatch_prefix(b)
    assert (bm.prefix_cache_hits, bm.prefix_cache_queries) == (hits, queries)
    assert [bm.blocks[i].ref_count for i in a.block_table] == [1, 1, 1]


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    admit(bm, make_seq(range(9), "a"))
    assert admit(bm, make_seq(range(9), "b")) == 0 and bm.prefix_cache_hits == 0


def test_same_prefix_computed_twice_keeps_one_cached_copy_and_frees_the_other():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(range(6), "a"), make_seq(range(6), "b")
    for seq in (a, b):  # both admitted in the same step: neither can hit the other's block yet
        bm.match_prefix(seq)
        bm.allocate(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        bm.register_computed_blocks(seq)
    assert bm.blocks[a.block_table[0]].hash is not None and bm.blocks[b.block_table[0]].hash is None
    assert a.block_hashes == b.block_hashes  # b's chain continues even though its copy is unnamed
    bm.free(a)
    bm.free(b)
    assert len(bm.evictable) == 1 and bm.match_prefix(make_seq(range(6))) == 4


def test_block_hashes_do_not_collide_where_pythons_tuple_hash_does():
    """hash((p, c)) == hash((p + 2**61 - 1, c)) for ints: two different prefixes could name one block
    (a hit checks the block's own tokens, not the chain before it)."""
    chunk = (5, 6, 7, 8)
    parent = block_hash(None, (1, 2, 3, 4))
    assert hash((parent, chunk)) == hash((parent + 2**61 - 1, chunk))
    assert block_hash(parent, chunk) != block_hash(parent + 2**61 - 1, chunk)
    assert block_hash(None, chunk) == block_hash(None, chunk)  # deterministic across calls
