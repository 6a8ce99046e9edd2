"""An fp8 KV cache's exact positions (kiln.engine.exact_kv): the pool of float16 exact blocks (rings
per sequence, first-block copies that follow their fp8 block through the prefix cache, copies given
up under pressure), the slots a step writes, the fills after prefix-cache hits, and what the engine's
exact caches hold after real steps."""

import argparse

import pytest
import torch

import kiln.engine.llm_engine
import kiln.engine.model_runner
from kiln.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kiln.engine.block_manager import BlockManager
from kiln.engine.exact_kv import ExactBlockPool, ExactKVLayout, exact_kv_layout, exact_slots_for
from kiln.engine.kv_cache_args import add_kv_cache_arguments, kv_cache_config_from_args
from kiln.engine.sampling_params import SamplingParams as Params
from kiln.engine.sequence import Sequence
from kiln.verify import relative_error
from tests.distributed.checkpoints import record_logits, run_to_completion

MODEL = "random:tiny:seed=3"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_seq(tokens, name="r"):
    return Sequence(name, list(tokens), Params())


def admit(bm: BlockManager, seq: Sequence) -> int:
    """The scheduler's admission of a whole prompt in one step: match, allocate, compute, register."""
    reused = bm.match_prefix(seq)
    assert bm.can_allocate(seq, seq.num_uncomputed_tokens)
    bm.allocate(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)
    return reused


def manager(num_blocks=32, block_size=4, exact_blocks=12, ring=2, window=5):
    layout = ExactKVLayout(num_blocks=exact_blocks, ring_blocks=ring, window=window)
    return BlockManager(num_blocks, block_size, exact=ExactBlockPool(layout, block_size))


def test_layout_ring_covers_the_window_and_all_but_one_proposal():
    assert exact_kv_layout(None, 16, 8) is None
    assert exact_kv_layout(0, 16, 8) == ExactKVLayout(num_blocks=16, ring_blocks=0, window=0)
    assert exact_kv_layout(32, 16, 8) == ExactKVLayout(num_blocks=32, ring_blocks=2, window=32)
    assert exact_kv_layout(32, 16, 8, num_speculative_tokens=1).ring_blocks == 2
    assert exact_kv_layout(32, 16, 8, num_speculative_tokens=2).ring_blocks == 3  # 33 positions > 2 blocks
    assert exact_kv_layout(20, 8, 2).ring_blocks == 3


def test_a_sequence_gets_a_ring_and_a_first_block_copy_and_returns_the_ring():
    bm = manager()
    seq = make_seq(range(10))
    admit(bm, seq)
    assert len(seq.exact_ring) == 2 and seq.exact_first is not None
    assert len({seq.exact_first, *seq.exact_ring}) == 3
    assert seq.exact_fill == []  # computed by itself: nothing to copy in
    assert bm.exact.num_available == 12 - 3
    first_block = seq.block_table[0]
    bm.free(seq)
    assert seq.exact_ring is None and seq.exact_first is None
    # the ring is back; the first block's copy stays with its (cached, unreferenced) fp8 block
    assert bm.exact.first_block_copies.keys() == {first_block}
    assert list(bm.exact.reclaimable) == [first_block]
    assert len(bm.exact.free_ids) == 12 - 1 and bm.exact.num_available == 12


def test_a_prefix_hit_shares_the_first_block_copy_and_fills_the_ring_from_fp8():
    bm = manager()
    a = make_seq(range(100, 113), "a")  # 3 full blocks of 4 + 1
    admit(bm, a)
    b = make_seq(list(range(100, 112)) + [7, 8], "b")  # the same 3 blocks, then its own
    assert admit(bm, b) == 12
    assert b.exact_first == a.exact_first  # shared with the fp8 block it copies
    assert b.exact_ring != a.exact_ring and not set(b.exact_ring) & {*a.exact_ring, a.exact_first}
    # the ring (2 blocks of 4) is filled for positions [max(4, 12 - 8), 12) from b's fp8 slots
    size = 4
    expected = [
        (b.block_table[p // size] * size + p % size, b.exact_ring[(p // size) % 2] * size + p % size)
        for p in range(4, 12)
    ]
    assert b.exact_fill == expected


def test_a_first_block_copy_given_up_under_pressure_takes_its_block_out_of_the_prefix_cache():
    bm = manager(exact_blocks=6, ring=2)
    a = make_seq(range(100, 109), "a")
    admit(bm, a)
    first_block = a.block_table[0]
    bm.free(a)  # its copy becomes reclaimable; its blocks stay cached
    assert first_block in bm.evictable
    others = [make_seq(range(200 + 20 * i, 209 + 20 * i), f"o{i}") for i in range(2)]
    for seq in others:  # 2 x (ring 2 + copy 1) = 6: the last one takes a's copy back
        admit(bm, seq)
    assert first_block not in bm.exact.first_block_copies
    # the fp8 block left the prefix cache with its copy: a plain free block now
    assert first_block not in bm.evictable and first_block in bm.free_block_ids
    assert first_block not in bm.hash_to_block.values() and bm.blocks[first_block].hash is None
    assert bm.exact.num_available == 0
    bm.free(others[0])
    c = make_seq(range(100, 109), "c")
    # no hit: the first block and the one chained after it are computed again, exactly
    assert admit(bm, c) == 0
    assert c.exact_fill == []


def test_a_recycled_fp8_block_drops_its_copy():
    bm = manager(num_blocks=4, exact_blocks=12)
    a = make_seq(range(100, 108), "a")
    admit(bm, a)
    bm.free(a)  # 2 cached blocks
    b = make_seq(range(300, 316), "b")  # needs all 4 fp8 blocks: a's are evicted and reused
    admit(bm, b)
    assert bm.exact.first_block_copies == {b.block_table[0]: b.exact_first}
    assert bm.exact.reclaimable == {}


def test_exact_slots_of_a_step_go_to_the_first_block_copy_and_the_ring():
    seq = make_seq(range(40))
    seq.exact_first, seq.exact_ring = 9, [3, 5]
    size, ring = 4, 2
    slots = exact_slots_for(seq, 0, 19, size, ring)
    assert slots[:4] == [36, 37, 38, 39]  # positions 0-3: block 9
    assert slots[4:11] == [-1] * 7  # before the step's last ring * size = 8 positions
    # positions 11..18: blocks 2, 3, 4 of the sequence -> ring entries 0, 1, 0 (exact blocks 3, 5, 3)
    assert slots[11:] == [
        3 * 4 + 3,
        5 * 4 + 0,
        5 * 4 + 1,
        5 * 4 + 2,
        5 * 4 + 3,
        3 * 4 + 0,
        3 * 4 + 1,
        3 * 4 + 2,
    ]
    assert exact_slots_for(seq, 19, 20, size, ring) == [3 * 4 + 3]  # a decode step
    assert exact_slots_for(seq, 2, 6, size, 0) == [38, 39, -1, -1]  # window 0: the first block only


def _window_reads_survive(window, block_size, ring, proposals, prompt_len, steps, rng):
    """Simulate a sequence's ring through a prefill and speculative verify steps (each writes its real
    token and up to `proposals` guesses, as many as the scheduler gave it a slot for, then keeps a
    random number of them), slot by slot, with the slots exact_slots_for gives; True when every step's
    window reads the position it asks for."""
    seq = make_seq(range(prompt_len))
    seq.exact_first, seq.exact_ring = 0, list(range(1, ring + 1))
    held = {}  # exact slot -> the position last written there

    def step(start, end):
        for p, slot in zip(
            range(start, end), exact_slots_for(seq, start, end, block_size, ring), strict=True
        ):
            if slot >= 0:
                held[slot] = p
        ring_slot = [
            seq.exact_ring[(p // block_size) % ring] * block_size + p % block_size for p in range(end)
        ]
        return all(held.get(ring_slot[p]) == p for p in range(max(block_size, end - window), end))

    ok = step(0, prompt_len)
    computed = prompt_len
    for _ in range(steps):
        written = rng.randint(0, proposals)
        ok &= step(computed, computed + 1 + written)
        computed += 1 + rng.randint(0, written)  # the real token and the accepted proposals
    return ok


def test_rejected_proposals_never_overwrite_a_position_the_next_window_reads():
    import random

    rng = random.Random(0)
    for block_size in (8, 16):
        for window in (1, 5, 16, 20, 32, 33):
            for proposals in (0, 1, 3, 7):
                ring = exact_kv_layout(window, block_size, 1, proposals).ring_blocks
                for prompt_len in (3, 17, 40):
                    assert _window_reads_survive(window, block_size, ring, proposals, prompt_len, 60, rng), (
                        block_size,
                        window,
                        proposals,
                        prompt_len,
                    )
    # a ring one block shorter loses positions: the window alone (20 over blocks of 8 needs 3), and the
    # proposals (window 32, 3 proposals, blocks of 16: 34 positions need 3 blocks)
    assert not _window_reads_survive(20, 8, 2, 0, 17, 10, rng)
    assert exact_kv_layout(32, 16, 1, 3).ring_blocks == 3
    assert not all(_window_reads_survive(32, 16, 2, 3, 17, 60, random.Random(s)) for s in range(10))


def test_the_exact_flag_parses_and_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_kv_cache_arguments(parser)
    assert kv_cache_config_from_args(parser.parse_args([]))["kv_cache_exact_window"] == 32
    assert (
        kv_cache_config_from_args(parser.parse_args(["--kv-cache-exact-window", "off"]))[
            "kv_cache_exact_window"
        ]
        is None
    )
    assert parser.parse_args(["--kv-cache-exact-window", "0"]).kv_cache_exact_window == 0
    for bad in ("-1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-cache-exact-window", bad])
    with pytest.raises(ValueError, match="kv_cache_exact_window=-2, expected an int >= 0 or None"):
        EngineConfig(kv_cache_exact_window=-2)


@pytest.fixture(scope="module")
def tiny():
    from kiln.loaders import load_model

    return load_model(MODEL, device="cpu")


def test_exact_caches_hold_the_unrounded_values_of_the_first_block_and_the_window(tiny):
    """After a prefill and a few decode steps, the exact caches hold, at every exact position of the
    sequence, the fp8 cache's value before its rounding: within one e4m3 step of the fp8 value, and
    not equal to it (unrounded), at the slots exact_slots_for gave."""
    engine = LLMEngine(
        EngineConfig(device="cpu", num_kv_blocks=16, kv_cache_dtype="fp8", kv_cache_exact_window=20),
        loaded=tiny,
    )
    prompt = list(range(3, 60))  # 57 tokens: first block, fp8 middle, window, over 4 blocks
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    seq = engine.requests["a"]
    length = seq.num_computed_tokens
    size, ring = 16, engine.runner.exact_kv.ring_blocks
    positions = [p for p in range(length) if p < size or p >= length - 20]
    rows = {p: seq.block_table[p // size] * size + p % size for p in positions}
    exact_rows = {
        p: (seq.exact_first if p < size else seq.exact_ring[(p // size) % ring]) * size + p % size
        for p in positions
    }
    for layer in engine.runner.kv_caches:
        for cache, exact in (
            (layer.key_cache, layer.exact_key_cache),
            (layer.value_cache, layer.exact_value_cache),
        ):
            fp8 = cache.view(-1, *cache.shape[2:])[list(rows.values())].float()
            unrounded = exact.view(-1, *exact.shape[2:])[list(exact_rows.values())].float()
            assert torch.isfinite(unrounded).all()
            # e4m3 keeps 3 mantissa bits: rounding moves a value by at most 2^-4 of it (plus subnormals)
            assert ((fp8 - unrounded).abs() <= unrounded.abs() / 16 + 2**-9).all()
            assert (fp8 != unrounded).float().mean() > 0.5
    engine.abort_request("a")


def _same_prompt_twice(tiny, prompt, window):
    """Step logits of a prompt run alone, then again on the same engine (a prefix-cache hit)."""
    config = EngineConfig(device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8", kv_cache_exact_window=window)
    engine = LLMEngine(config, loaded=tiny)
    logits = record_logits(engine)
    first = run_to_completion(engine, [prompt], GREEDY)
    count = len(logits)
    second = run_to_completion(engine, [prompt], GREEDY)
    assert engine.stats().prefix_cache_hits == 64  # 4 full blocks before the last token
    return first, second, [relative_error(b, a) for a, b in zip(logits[:count], logits[count:], strict=True)]


def test_a_prefix_hit_that_computes_its_window_gives_the_logits_of_the_run_that_computed_the_prefix(tiny):
    """A 76-token prompt twice: the second run shares the first one's fp8 blocks and its first block's
    exact copy and computes its last 12 positions itself, which hold the whole window of 8: every
    position it reads is the value the first run read, so its logits are the first run's up to float32
    rounding (bit for bit where the GEMMs of 12 and 76 rows block alike; the fp8 error is ~1e-3)."""
    first, second, errors = _same_prompt_twice(tiny, list(range(5, 81)), window=8)
    assert second == first and max(errors) < 1e-5, errors


def test_a_prefix_hit_inside_the_window_reads_the_filled_fp8_values(tiny, monkeypatch):
    """A 67-token prompt twice: the second run computes only 3 positions, so 5 of its window's come
    from the prefix cache, copied into its ring from the fp8 cache: rounded, so its logits are within
    fp8's error of the first run's (measured 1e-4 to 1.5e-3). Without that copy its ring holds stale
    data and it is more than 10x further off (measured 5e-3 to 6e-2)."""
    prompt = list(range(5, 72))
    first, second, errors = _same_prompt_twice(tiny, prompt, window=8)
    assert second == first and max(errors) < 5e-3, errors
    monkeypatch.setattr(kiln.engine.model_runner, "copy_exact_fill", lambda *args: None)
    _, _, unfilled = _same_prompt_twice(tiny, prompt, window=8)
    assert max(unfilled) > 10 * max(errors), (unfilled, errors)


def test_compiled_cpu_decode_with_exact_positions_gives_the_eager_tokens(tiny):
    eager = LLM(loaded=tiny, device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8", max_num_seqs=2)
    compiled = LLM(
        loaded=tiny,
        device="cpu",
        num_kv_blocks=32,
        kv_cache_dtype="fp8",
        max_num_seqs=2,
        compile_cpu_decode=True,
    )
    prompts = [list(range(7, 47)), list(range(90, 97))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)  # past the 32-position window
    assert [o.token_ids for o in compiled.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]
    assert compiled.engine.runner.compiled_decode.compiled_sizes == {2}


def test_keys_and_values_past_the_scales_headroom_stay_exact_in_the_window(tiny, monkeypatch):
    """Scales 8x below the calibrated ones put the keys and values up to ~8x past e4m3's +-448: the fp8
    cache saturates them, the exact caches must not (only at float16's +-65504). A 20-token prompt and
    6 greedy tokens sit inside the first block and the 32-position window, so every read is exact and
    the tokens and logits are the float32 cache's up to float16 rounding (measured 1.2e-4 to 2e-4;
    saturating the exact copies at +-448, as before, put the logits 0.3 to 1.5 off and changed every
    token after the first)."""
    calibrate = kiln.engine.llm_engine.engine_kv_calibration

    def shrunk(*args, **kwargs):
        calibration = calibrate(*args, **kwargs)  # None for the float32 cache
        return calibration and [(k_scale / 8, v_scale / 8, shift) for k_scale, v_scale, shift in calibration]

    monkeypatch.setattr(kiln.engine.llm_engine, "engine_kv_calibration", shrunk)
    prompt = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 7, 8, 9, 10, 11, 12, 13, 14, 200]
    tokens = {}
    for name in ("auto", "fp8"):
        engine = LLMEngine(
            EngineConfig(device="cpu", num_kv_blocks=16, kv_cache_dtype=name, kv_cache_exact_window=32),
            loaded=tiny,
        )
        if name == "auto":
            logits = record_logits(engine)  # on the shared model: the fp8 run's logits follow
        tokens[name] = run_to_completion(engine, [prompt], GREEDY)
    steps = len(logits) // 2
    errors = [relative_error(b, a) for a, b in zip(logits[:steps], logits[steps:], strict=True)]
    assert tokens["fp8"] == tokens["auto"] and max(errors) < 1e-3, errors
    exact_peak = max(layer.exact_key_cache.float().abs().max() for layer in engine.runner.kv_caches)
    assert exact_peak > 2 * 448, exact_peak  # the case is real: the fp8 cache saturated these keys
