"""LLMEngine end to end on the toy paged-KV model: batching, prefix cache, preemption and chunked
prefill must not change greedy tokens; stops, aborts and request validation."""

import pytest

from kiln.engine import LLM, EngineConfig, LLMEngine, SamplingParams

from .toy_model import EOS, toy_loaded

PROMPTS = ["hello world", "abc", "a much longer prompt, over several blocks!", "xyz" * 7, "q"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return toy_loaded()


def make_llm(loaded, **kw):
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(loaded=loaded, **kw)


@pytest.fixture(scope="module")
def reference(loaded):
    """Greedy tokens of each prompt run alone, no prefix caching, big budget."""
    llm = make_llm(loaded, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def test_batched_generation_equals_one_at_a_time(loaded, reference):
    outs = make_llm(loaded, enable_prefix_caching=False).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)


def test_prefix_cache_hits_give_the_same_tokens_as_misses(loaded, reference):
    llm = make_llm(loaded)
    first = llm.generate(PROMPTS, GREEDY)
    hits_before = llm.engine.stats().prefix_cache_hits
    second = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats().prefix_cache_hits > hits_before
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == reference
    assert max(o.num_cached_tokens for o in second) > 0


def test_tiny_kv_cache_forces_preemption_and_tokens_stay_the_same(loaded, reference):
    # 14 blocks x 4 slots = 56 tokens for 5 requests that need up to 66 each: must preempt
    llm = make_llm(loaded, num_kv_blocks=18, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_preempted_request_waits_for_room_instead_of_thrashing(loaded, prefix_caching):
    """Two long generations in a cache that holds one: the preempted one was re-admitted on its first
    chunk, ran out of blocks chunks later, preempted itself and started over every few steps (316
    preemptions, 48x the model work without the prefix cache)."""
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=150, block_size=16, enable_prefix_caching=prefix_caching), loaded=loaded
    )
    before = loaded.model.tokens_seen
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    for i in range(2):
        engine.add_request(str(i), [2 + i] * 20, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_preemptions <= 2
    assert loaded.model.tokens_seen - before < 1.5 * 2 * 2019


def test_chunked_prefill_with_a_small_token_budget_gives_the_same_tokens(loaded, reference):
    llm = make_llm(loaded, max_num_batched_tokens=5)
    model = loaded.model
    calls = model.forward_calls
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert model.forward_calls - calls > 24 + 40 // 5  # the long prompt alone needed 9 chunks


def test_stop_string_truncates_text_and_finishes_with_stop(loaded, reference):
    llm = make_llm(loaded)
    full = llm.generate(PROMPTS[2], GREEDY)[0]
    text = full.text
    unique_suffix = next(text[-k:] for k in range(1, len(text) + 1) if text.index(text[-k:]) == len(text) - k)
    # a stop string in the middle, one never produced, one completed only by the last (max_tokens) token
    for stop in (text[5:8], text[-2:] + "\u00a7", unique_suffix):
        out = llm.generate(
            PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        )[0]
        if stop in full.text:
            assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
        else:
            assert out.finish_reason == "length" and out.text == full.text


def _stream(engine, prompts, params):
    """Every output of each request, step by step, in order."""
    streams = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams[out.request_id].append(out)
    return [streams[str(i)] for i in range(len(prompts))]


def test_output_kinds_give_the_same_final_output_and_text_never_shrinks(loaded):
    """cumulative outputs only grow (a tail that may start a stop string is held back until it is
    ruled out or the stop string ends the request); deltas concatenate to the cumulative output;
    final_only gives that output once."""
    prompt = PROMPTS[2]
    full = make_llm(loaded).generate(prompt, GREEDY)[0].text
    # one stop string that completes, one whose first 2 characters appear but which never completes
    end = next(i for i in range(10, len(full) - 3) if full.index(full[i : i + 3]) == i)
    stop = full[end : end + 3]
    start = next(
        i for i in range(end - 2) if full[i : i + 2] not in stop and full.index(full[i : i + 2]) == i
    )
    stops = [stop, full[start : start + 2] + "\u00a7"]
    kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stops, logprobs=2)
    prompts = [prompt, PROMPTS[0], PROMPTS[3]]
    runs = {}
    for kind in ("cumulative", "delta", "final_only"):
        engine = LLMEngine(EngineConfig(num_kv_blocks=256, block_size=4), loaded=loaded)
        ids = [engine.tokenizer.encode(p) for p in prompts]
        runs[kind] = _stream(engine, ids, SamplingParams(output_kind=kind, **kw))
    held_back = False
    for cumulative, delta, final in zip(runs["cumulative"], runs["delta"], runs["final_only"], strict=True):
        last = cumulative[-1]
        assert last.finished and [o.finished for o in cumulative[:-1]] == [False] * (len(cumulative) - 1)
        for before, after in zip(cumulative, cumulative[1:], strict=False):
            assert after.text.startswith(before.text)
            assert after.token_ids[: len(before.token_ids)] == before.token_ids
            held_back |= len(before.text) < len(loaded.tokenizer.decode(before.token_ids))
        assert len(delta) == len(cumulative) and len(final) == 1 and final[0].finished
        assert "".join(o.text for o in delta) == last.text == final[0].text
        assert sum((o.token_ids for o in delta), []) == last.token_ids == final[0].token_ids
        assert sum((o.logprobs for o in delta), []) == last.logprobs == final[0].logprobs
        assert all(o.prompt_token_ids == last.prompt_token_ids for o in delta)
    assert runs["cumulative"][0][-1].finish_reason == "stop"
    assert runs["cumulative"][0][-1].text == full[:end]
    assert held_back  # the never-completed stop string's start was held back at some step


def test_prompt_logprobs_do_not_depend_on_chunking_caching_or_preemption(loaded):
    """Prompt logprobs are taken from computed logits: the same under chunked prefill, a warm prefix
    cache (skipped for such requests until their logprobs are taken) and preemption, and they
    score the prompt's own next tokens under the toy model's full-prompt logits."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    alone = [make_llm(loaded).generate(p, params)[0] for p in PROMPTS]
    for out in alone:
        entries = out.prompt_logprobs
        assert len(entries) == len(out.prompt_token_ids) and entries[0] is None
        for token, entry in zip(out.prompt_token_ids[1:], entries[1:], strict=True):
            assert token in entry and len(entry) in (3, 4) and max(entry.values()) <= 0.0
    ids = alone[2].prompt_token_ids
    logp = loaded.model.full_logits(ids).double().log_softmax(-1)
    expected = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    got = [entry[t] for t, entry in zip(ids[1:], alone[2].prompt_logprobs[1:], strict=True)]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-5
    setups = {
        "chunked": make_llm(loaded, max_num_batched_tokens=5),
        "cached": make_llm(loaded),
        "preempted": make_llm(loaded, num_kv_blocks=18, enable_prefix_caching=False),
    }
    setups["cached"].generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0))  # warm the cache
    for name, llm in setups.items():
        outs = llm.generate(PROMPTS, params)
        for out, ref in zip(outs, alone, strict=True):  # float32 sums in another order: not bit-equal
            assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) and out.prompt_logprobs[0] is None
            for got_entry, ref_entry in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
                assert got_entry.keys() == ref_entry.keys(), name
                assert max(abs(got_entry[t] - v) for t, v in ref_entry.items()) < 1e-4, name
        assert [o.token_ids for o in outs] == [o.token_ids for o in alone], name
        if name == "preempted":
            assert llm.engine.stats().num_preemptions > 0
        if name == "cached":
            assert all(o.num_cached_tokens == 0 for o in outs)


def test_a_prompt_logprobs_request_waiting_for_blocks_keeps_the_prefix_counters(loaded):
    """It looks nothing up in the prefix cache, so the undo of a failed admission (it waits while the
    running request holds the blocks) must not subtract its prompt from the lookups: they went to
    -580 over 22 steps."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=12, block_size=4), loaded=loaded)
    engine.add_request("a", [3] * 20, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.add_request("b", [4] * 30, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    lowest, waited = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        lowest = min(lowest, stats.prefix_cache_queries)
        waited += stats.num_waiting
    assert waited > 0 and lowest >= 0 and engine.stats().prefix_cache_queries == 20


def test_an_unknown_output_kind_is_refused():
    with pytest.raises(ValueError, match="output_kind='streaming'"):
        SamplingParams(output_kind="streaming")


def test_max_tokens_and_eos_end_requests(loaded):
    llm = make_llm(loaded)
    out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(out.token_ids) <= 3
    # the toy model emits EOS at some point for some prompt under sampling; EOS always ends with "stop"
    outs = llm.generate(
        ["x" * i for i in range(1, 9)], SamplingParams(max_tokens=40, temperature=1.0, seed=0)
    )
    for o in outs:
        if EOS in o.token_ids:
            assert o.token_ids[-1] == EOS and o.finish_reason == "stop"
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 40


def test_seeded_sampling_reproduces_whatever_else_runs(loaded):
    llm = make_llm(loaded)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=7, ignore_eos=True)
    alone = llm.generate("seeded", params)[0].token_ids
    mixed = llm.generate(["other", "seeded", "more"], [SamplingParams(temperature=1.0), params, params])
    assert mixed[1].token_ids == alone and len(alone) == 16


def test_logprobs_come_back_per_output_token(loaded):
    out = make_llm(loaded).generate(
        "abc", SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, ignore_eos=True)
    )[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and max(entry.values()) == entry[token]  # greedy picks the top


def test_add_request_rejects_too_long_duplicate_and_empty_prompts(loaded):
    engine = LLMEngine(EngineConfig(num_kv_blocks=8, block_size=4), loaded=loaded)
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", list(range(2, 30)), SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [], SamplingParams())
    engine.add_request("c", [3, 4], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("c", [3, 4], SamplingParams())


def test_abort_frees_blocks_and_reports_abort(loaded):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4), loaded=loaded)
    engine.add_request("a", "some prompt", SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", "another", SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    engine.abort_request("a")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort"
    engine.abort_request("b")
    engine.step()
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and not engine.has_unfinished_requests()


def test_stats_count_prompt_and_generated_tokens(loaded):
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4), loaded=loaded)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.prompt_tokens_total == 3 and stats.generation_tokens_total == 4
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_total == 64


def test_chat_applies_the_template(loaded):
    llm = make_llm(loaded)
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out.prompt_token_ids == loaded.tokenizer.encode(text, add_special_tokens=False)


def test_a_cpu_engine_loads_the_native_kernels_at_start_not_in_its_first_step(loaded, monkeypatch):
    """A host's first run builds Kiln's native CPU library (~30-60 s): that belongs to loading, not to
    the first decode step, whose time `kiln generate` reports as tok/s."""
    from kiln.ops import native_cpu
    from kiln.ops.attention.paged_decode_attention import cpu_native

    calls = []
    monkeypatch.setitem(cpu_native._state, "loaded", None)
    monkeypatch.setattr(native_cpu, "load", lambda: calls.append("load") or False)
    llm = make_llm(loaded)
    assert calls == ["load"]
    llm.generate(PROMPTS[:2], GREEDY)
    assert calls == ["load"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_fail_only_their_request_and_the_others_run_on_unchanged(loaded, monkeypatch, temperature):
    """The model gives one request NaN logits at its 3rd output token. The step raises SamplingError
    naming only it (as the server's AsyncEngine expects); once it is aborted, the others finish with
    the tokens they get in a run without it (seeded, so sampling rows are comparable too)."""
    from kiln.engine.sampler import SamplingError

    def params(seed):
        return SamplingParams(max_tokens=6, temperature=temperature, seed=seed, ignore_eos=True)

    clean = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4), loaded=loaded)
    for i in (0, 2):
        clean.add_request(f"r{i}", PROMPTS[i], params(i))
    expected = {}
    while clean.has_unfinished_requests():
        expected.update({out.request_id: out.token_ids for out in clean.step()})

    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4), loaded=loaded)
    runner, order = engine.runner, []
    prepare, collect = runner.prepare, runner.collect

    def remember(batch):
        inputs, rows = prepare(batch)
        order[:] = zip(rows.starts, rows.seqs, strict=True)
        return inputs, rows

    def poison(handle):
        logits = collect(handle).clone()
        for row, seq in order:
            if seq.request_id == "r1" and seq.num_output_tokens == 2:
                logits[row, 5] = float("nan")
        return logits

    monkeypatch.setattr(runner, "prepare", remember)
    monkeypatch.setattr(runner, "collect", poison)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i], params(i))
    got, failures = {}, []
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except SamplingError as exc:
            failures.append(exc.failures)
            for request_id in exc.failures:
                engine.abort_request(request_id)
            continue
        got.update({out.request_id: (out.token_ids, out.finish_reason) for out in outputs})
    assert [list(f) for f in failures] == [["r1"]] and "not finite" in failures[0]["r1"]
    assert got["r1"][1] == "abort" and len(got["r1"][0]) == 2
    assert {rid: got[rid][0] for rid in ("r0", "r2")} == expected


def test_an_abort_is_reported_by_a_has_unfinished_loop_and_survives_a_failed_step(loaded, monkeypatch):
    """has_unfinished_requests() ignored pending aborts (the only request's abort was never seen), and
    a step that raised dropped the aborts it had collected."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, block_size=4), loaded=loaded)
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.abort_request("a")
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert [(o.request_id, o.finish_reason) for o in seen] == [("a", "abort")]

    engine.add_request("b", [3, 4, 5], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.add_request("c", [6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.abort_request("b")
    monkeypatch.setattr(engine.runner, "run", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    monkeypatch.undo()
    assert ("b", "abort") in [(o.request_id, o.finish_reason) for o in engine.step()]


def test_prefix_cache_counts_prompt_lookups_only_once_across_preemptions(loaded):
    """A re-admitted (preempted) sequence looked up its output too: a 9-token prompt reported 16 cached
    tokens and the lookups exceeded the prompt tokens."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=12, block_size=4), loaded=loaded)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("old", list(range(2, 10)), params)
    engine.add_request("new", list(range(2, 10)) + [11], params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_queries == stats.prompt_tokens_total == 17
    assert all(o.num_cached_tokens <= len(o.prompt_token_ids) for o in finished.values())


def test_a_bad_prompt_leaves_no_request_of_its_generate_call_running(loaded):
    llm = make_llm(loaded, num_kv_blocks=64)
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([[3, 4, 5], [3, 999]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert not llm.engine.requests
    out = llm.generate([[7, 8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 2 and not llm.engine.requests
