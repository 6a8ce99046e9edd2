"""Scheduler: token budget, chunked prefill, decodes first, max_num_seqs, preemption and stops.

No model: each step 'computes' what was scheduled and samples token 7 for every sequence whose
prefill completes, exactly as the engine's postprocess expects."""

from kiln.engine.block_manager import BlockManager
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Sequence, SequenceStatus

EOS = 1


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, eos_token_ids=[EOS])


def add(sched, name, prompt_len, max_tokens=8, first_token=10, **kw):
    seq = Sequence(
        name, list(range(first_token, first_token + prompt_len)), SamplingParams(max_tokens=max_tokens, **kw)
    )
    sched.add(seq)
    return seq


def step(sched, token=7):
    batch = sched.schedule()
    sampled = [
        token if s.num_computed_tokens + n == s.num_tokens else None
        for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
    ]
    sched.postprocess(batch, sampled)
    return batch


def test_chunked_prefill_respects_the_token_budget_and_samples_only_at_the_end():
    sched = make_scheduler(budget=16)
    seq = add(sched, "a", 50)
    chunks = []
    while seq.num_output_tokens == 0:
        batch = step(sched)
        assert batch.total_tokens <= 16
        chunks.append(batch.num_tokens[0])
    assert chunks == [16, 16, 16, 2]
    assert seq.output_token_ids == [7]


def test_decodes_are_scheduled_before_prefill_chunks_and_new_requests():
    sched = make_scheduler(budget=10)
    a = add(sched, "a", 6)
    step(sched)  # a prefilled, now decoding
    b = add(sched, "b", 30, first_token=100)
    c = add(sched, "c", 5, first_token=200)
    batch = step(sched)
    assert batch.seqs[0] is a and batch.num_tokens[0] == 1
    assert batch.seqs[1] is b and batch.num_tokens[1] == 9  # the rest of the budget goes to b's chunk
    assert c not in batch.seqs
    batch = step(sched)
    assert batch.seqs[:2] == [a, b] and batch.num_tokens[:2] == [1, 9]


def test_budget_and_max_num_seqs_cap_each_step():
    sched = make_scheduler(budget=12, max_num_seqs=3)
    seqs = [add(sched, f"r{i}", 5, first_token=10 * i + 10) for i in range(5)]
    batch = step(sched)
    assert batch.total_tokens == 12 and len(batch) == 3  # 5 + 5 + a 2-token chunk of the third
    assert len(sched.running) == 3 and len(sched.waiting) == 2
    for _ in range(5):
        batch = step(sched)
        assert len(batch) <= 3 and batch.total_tokens <= 12
    assert all(s.num_output_tokens >= 1 for s in seqs[:3])


def test_preemption_frees_the_newest_and_resumes_it_without_losing_tokens():
    # 6 blocks of 4 slots; two 8-token prompts take 4 blocks; decoding soon needs more than 6
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    old = add(sched, "old", 8, max_tokens=12)
    new = add(sched, "new", 8, max_tokens=12, first_token=50)
    preempted_at = None
    for i in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
        if sched.num_preemptions and preempted_at is None:
            preempted_at = i
            assert new.status is SequenceStatus.WAITING and sched.waiting[0] is new
            assert new.block_table == [] and new.num_computed_tokens == 0
            assert new.num_output_tokens > 0  # generated tokens are kept and recomputed as prompt
    assert preempted_at is not None
    for seq in (old, new):
        assert seq.finish_reason == "length" and seq.num_output_tokens == 12
        assert seq.prompt_token_ids == list(range(10 if seq is old else 50, (10 if seq is old else 50) + 8))
    assert sched.block_manager.num_used_blocks == 0


def test_preemption_never_admits_new_work_in_the_same_step():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64, caching=False)
    add(sched, "a", 7, max_tokens=8)
    add(sched, "b", 7, max_tokens=8, first_token=40)
    step(sched)
    add(sched, "c", 2, first_token=90)
    while sched.num_preemptions == 0:
        batch = step(sched)
    assert all(s.request_id != "c" for s in batch.seqs)


def test_stops_on_eos_unless_ignored_and_on_stop_token_ids():
    sched = make_scheduler()
    eos = add(sched, "eos", 3)
    ignore = add(sched, "ignore", 3, ignore_eos=True, max_tokens=2, first_token=20)
    stop = add(sched, "stop", 3, stop_token_ids=[7], ignore_eos=True, first_token=30)
    step(sched, token=EOS)
    assert eos.finish_reason == "stop" and eos.output_token_ids == [EOS]
    assert ignore.status is SequenceStatus.RUNNING
    assert stop.status is SequenceStatus.RUNNING
    step(sched, token=7)
    assert stop.finish_reason == "stop" and stop.output_token_ids == [EOS, 7]
    assert ignore.finish_reason == "length" and ignore.num_output_tokens == 2
    assert sched.block_manager.num_used_blocks == 0


def test_finish_aborts_waiting_and_running_requests_and_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    running = add(sched, "a", 5)
    waiting = add(sched, "b", 5, first_token=40)
    step(sched)
    sched.finish(waiting, "abort")
    sched.finish(running, "abort")
    assert not sched.has_unfinished() and sched.block_manager.num_used_blocks == 0
    assert running.finish_reason == waiting.finish_reason == "abort"


def test_admission_uses_the_prefix_cache():
    sched = make_scheduler(budget=64)
    a = add(sched, "a", 12)
    step(sched)
    b = add(
        sched, "b", 12
    )  # same 12 tokens: blocks 0-1 are shared, block 2 (holds the last token) recomputed
    batch = step(sched)
    assert batch.num_tokens[batch.seqs.index(b)] == 4
    assert b.block_table[:2] == a.block_table[:2]


def test_prompt_logprob_prefill_is_chunked_to_the_rows_a_step_may_hold():
    """A request asking for prompt logprobs gets the logits of every prompt position: at most
    PROMPT_LOGPROB_ROWS of them a step, whatever the token budget; other requests use the rest."""
    from kiln.engine.scheduler import PROMPT_LOGPROB_ROWS

    sched = make_scheduler(num_blocks=2048, block_size=16, budget=4096, max_model_len=8192)
    scored = add(sched, "scored", 2500, prompt_logprobs=1)
    plain = add(sched, "plain", 2000, first_token=5000)
    chunks = []
    while scored.num_output_tokens == 0:
        batch = step(sched)
        sizes = dict(zip((s.request_id for s in batch.seqs), batch.num_tokens, strict=True))
        chunks.append(sizes.get("scored", 0))
        assert plain.num_computed_tokens > 0, "the plain request waited behind the scored one"
        # what the runner does: one entry per prompt position computed (a logits row each)
        done = min(scored.num_computed_tokens, scored.num_prompt_tokens - 1)
        scored.prompt_logprobs.extend([{}] * (done + 1 - len(scored.prompt_logprobs)))
    assert chunks == [PROMPT_LOGPROB_ROWS, PROMPT_LOGPROB_ROWS, 2500 - 2 * PROMPT_LOGPROB_ROWS]
    assert not scored.prompt_logprobs_pending and plain.num_output_tokens > 0


def _two_decoding(num_speculative_tokens: int):
    """A (older, 3 tokens) and B (newer, 4 tokens) decoding in a 3-block cache of 4-token blocks: B's
    next token needs the last free block."""
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    scheduler = Scheduler(
        bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=12,
        num_speculative_tokens=num_speculative_tokens,
    )  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0)
    seqs = [Sequence("A", [2, 3, 4], params), Sequence("B", [5, 6, 7, 8], params)]
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
        bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(9)  # sampled, not computed yet
    return scheduler, seqs


def test_proposal_slots_never_take_the_block_a_newer_request_needs_for_its_real_token():
    """A's guesses took the last free block, and B, needing it for its one real token, was preempted
    (its KV dropped and recomputed), although proposal slots are never worth a preemption."""
    scheduler, (_, b) = _two_decoding(num_speculative_tokens=4)
    batch = scheduler.schedule()
    scheduled = [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_tokens, strict=True)]
    assert scheduled == [("A", 1), ("B", 1)]
    assert scheduler.num_preemptions == 0 and b.status is SequenceStatus.RUNNING
    assert batch.spec_caps == [0, 0]  # no free block left for a guess


def test_proposal_slots_come_from_the_budget_left_after_admissions():
    """Running decodes x (k + 1) filled the token budget before the proposer ran, so a waiting request
    was not admitted until they finished (first token at step 33 of 40 with a budget of 8)."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    scheduler = Scheduler(
        bm, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, num_speculative_tokens=4
    )
    params = SamplingParams(max_tokens=40, temperature=0.0)
    for name in ("A", "B"):
        seq = Sequence(name, [10, 11, 12], params)
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
        bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(13)
    scheduler.add(Sequence("C", [30, 31, 32, 33], params))
    batch = scheduler.schedule()
    scheduled = {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens, strict=True)}
    assert scheduled["C"] == 4  # admitted: its whole prompt
    assert sum(scheduled.values()) <= 8 and scheduled["A"] + scheduled["B"] == 4  # guesses: what is left
    assert batch.spec_caps[:2] == [scheduled["A"] - 1, scheduled["B"] - 1]


def assert_blocks_accounted(bm: BlockManager, seqs) -> None:
    """Every block is exactly one of: referenced (ref_count = tables holding it), plain free, or free and
    cached (evictable, named); hash_to_block names only blocks that hold their hash."""
    refs = {}
    for seq in seqs:
        for block_id in seq.block_table:
            refs[block_id] = refs.get(block_id, 0) + 1
    free, evictable = set(bm.free_block_ids), set(bm.evictable)
    assert len(free) == len(bm.free_block_ids) and not free & evictable and not free & refs.keys()
    assert not evictable & refs.keys() and len(free) + len(evictable) + len(refs) == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.hash is not None) == (block.block_id in evictable) or block.block_id in refs
    assert all(bm.blocks[b].hash == h for h, b in bm.hash_to_block.items())
    assert all(bm.hash_to_block.get(bm.blocks[b].hash) == b for b in evictable)


def _cached_prompt_then_speculating_decode(num_blocks: int):
    """A (9 tokens, 4-token blocks) finished: its 2 full blocks are free but cached. R (14 tokens) then
    prefilled into the plain free blocks and decodes with k=4: its next token fits its last block, its
    guesses need one more block. Returns the scheduler, A's cached blocks (LRU first), R and R's first
    decode step."""
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(bm, 8, 64, 64, eos_token_ids=[EOS], num_speculative_tokens=4)
    a = add(sched, "a", 9, max_tokens=1)
    step(sched)
    assert a.status is SequenceStatus.FINISHED and len(bm.evictable) == 2
    a_blocks = list(bm.evictable)  # A's last full block was released first
    r = add(sched, "r", 14, max_tokens=8, first_token=100)
    step(sched)
    assert len(bm.free_block_ids) == num_blocks - 6 and len(r.block_table) == 4
    return sched, a_blocks, r, sched.schedule()


def test_proposal_slots_take_plain_free_blocks_before_cached_ones():
    """With a plain free block there, R's k slots come from it and A's cached blocks stay; the guess
    block goes back to the plain free list after the step."""
    sched, a_blocks, r, batch = _cached_prompt_then_speculating_decode(num_blocks=7)
    bm = sched.block_manager
    assert batch.spec_caps == [4] and batch.num_tokens == [5] and len(r.block_table) == 5
    assert list(bm.evictable) == a_blocks and not bm.free_block_ids
    assert_blocks_accounted(bm, [r])
    batch.num_tokens[0] = 1  # what the engine does when no proposal came
    sched.postprocess(batch, [7])
    assert len(r.block_table) == 4 and len(bm.free_block_ids) == 1 and len(bm.evictable) == 2
    assert_blocks_accounted(bm, [r])


def test_proposal_slots_evict_one_lru_cached_block_and_then_reuse_it():
    """With no plain free block, R's guesses evict the least recently released cached block (A's last
    full one) as a real token would (vLLM's lookahead slots too): once the prefix cache fills the pool
    every free block is a cached one, and guesses held to plain free blocks mostly stop. The cost is
    one block per speculating sequence: it comes back unnamed after the step and the next guesses
    take it again, evicting nothing more."""
    sched, a_blocks, r, batch = _cached_prompt_then_speculating_decode(num_blocks=6)
    bm = sched.block_manager
    assert batch.spec_caps == [4] and len(r.block_table) == 5
    assert list(bm.evictable) == a_blocks[1:] and a_blocks[0] == r.block_table[4]
    assert bm.blocks[a_blocks[0]].hash is None and a_blocks[0] not in bm.hash_to_block.values()
    assert_blocks_accounted(bm, [r])
    batch.num_tokens[0] = 1  # no proposal filled: only the real token is computed
    sched.postprocess(batch, [7])
    assert len(r.block_table) == 4 and list(bm.free_block_ids) == a_blocks[:1]  # back, unnamed
    assert_blocks_accounted(bm, [r])
    batch = sched.schedule()  # the next guesses take it again: nothing more evicted
    assert batch.spec_caps == [4] and r.block_table[4] == a_blocks[0] and list(bm.evictable) == a_blocks[1:]
    assert_blocks_accounted(bm, [r])
    sched.finish(r, "abort")
    assert_blocks_accounted(bm, [])
    b = add(sched, "b", 9)  # A's prompt: its first block is still a hit
    step(sched)
    assert b.num_cached_tokens == 4 and b.block_table[0] == a_blocks[1]
    assert_blocks_accounted(bm, [b])
