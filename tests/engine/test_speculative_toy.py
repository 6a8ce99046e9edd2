"""Speculative decoding on the toy paged-KV model: with n-gram or draft-model proposals, greedy
tokens equal decoding without speculation: batched, with prefix caching, chunked prefill and
preemption, and when EOS, a stop token, a stop string or max_tokens ends a request in the middle of
a run of accepted proposals. Rejected proposals leave no KV blocks behind and never enter the prefix
cache."""

import random
from types import SimpleNamespace

import pytest

from kiln.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kiln.engine.block_manager import block_hash
from kiln.engine.sequence import Sequence, SequenceStatus
from kiln.engine.speculative import SpeculativeConfig
from kiln.engine.speculative.ngram import NgramProposer, ngram_propose
from kiln.loaders import LoadedModel

from .toy_model import ToyTokenizer, toy_loaded

# repetitive prompts, so prompt lookup finds matches
PROMPTS = [
    "abcabcabcabc",
    "hello world, hello world, hello",
    "a much longer prompt, over several blocks!",
    "q",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return toy_loaded()


@pytest.fixture(scope="module")
def draft_loaded():
    return toy_loaded(seed=3)  # another random toy of the same vocabulary: a poor but valid draft


def make_llm(loaded, spec=None, **kw):
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(loaded=loaded, speculative=spec, **kw)


def ngram(k=4):
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, ngram_min=1, ngram_max=3)


def draft(loaded_draft, k=3):
    return SpeculativeConfig(method="draft", draft_model=loaded_draft, num_speculative_tokens=k)


@pytest.fixture(scope="module")
def reference(loaded):
    llm = make_llm(loaded, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def test_ngram_propose_continues_the_latest_match_that_has_k_tokens_after_it():
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 3, 5, 6]
    assert ngram_propose(tokens, 3, 1, 3) == [7, 1, 2]  # "5 6" recurs at 5..6 and 0..1: latest wins
    assert ngram_propose(tokens, 5, 2, 2) == [7, 1, 2, 3, 5]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []  # no suffix recurs
    assert ngram_propose([4, 4, 4], 4, 1, 1) == [4, 4]  # no k tokens after any match: the longest


def _ngram_propose_by_scanning(tokens, k, ngram_min, ngram_max):
    """The rule written as a plain scan: longest n first; of the earlier occurrences of the last n
    tokens, the latest with k tokens after it, else the one with the most tokens after it."""
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == tokens[len(tokens) - n :]]
        if ends:
            full = [e for e in ends if len(tokens) - e >= k]
            start = full[-1] if full else ends[0]
            return tokens[start : start + k]
    return []


def test_ngram_propose_matches_a_plain_scan_on_random_histories():
    rng = random.Random(7)
    checked = 0
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 5), rng.randint(1, 6)
        expected = _ngram_propose_by_scanning(tokens, k, lo, hi)
        assert ngram_propose(tokens, k, lo, hi) == expected, (tokens, k, lo, hi)
        checked += bool(expected)
    assert checked > 1000  # most draws recur somewhere


def test_ngram_proposer_follows_a_growing_history():
    proposer = NgramProposer(1, 3)
    seq = Sequence("r", [1, 2, 3, 9, 1, 2], SamplingParams())
    assert proposer.propose([seq], [2], None)[0].token_ids == [3, 9]
    seq.token_ids += [3, 9, 1, 2, 3]
    assert proposer.propose([seq], [3], None)[0].token_ids == [9, 1, 2]
    seq.status = SequenceStatus.FINISHED
    proposer.release_finished()
    assert not proposer.histories


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_ngram_speculation_gives_the_same_tokens_batched_and_cached(loaded, reference, k):
    llm = make_llm(loaded, ngram(k))
    first = llm.generate(PROMPTS, GREEDY)
    second = llm.generate(PROMPTS, GREEDY)  # prefix-cache hits this time
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == reference
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_proposed_tokens > stats.spec_accepted_tokens
    assert stats.generation_tokens_total == 2 * 32 * len(PROMPTS) and stats.kv_blocks_used == 0


def test_a_draft_with_a_shorter_context_stops_proposing_where_its_positions_end(loaded):
    """A draft of 40 positions beside a target of 4096: a sequence reaching past 40 crashed the whole
    step (IndexError in the draft's RoPE cache). It gets no proposals there; the tokens stay the
    target's, and sequences within the draft's context still get proposals."""
    short_draft = toy_loaded(seed=3, max_pos=40)
    prompts = [[5, 6, 7] * 4, [5, 6, 7] * 15]  # 12 tokens, and 45 (past the draft's 40)
    want = [o.token_ids for o in make_llm(loaded).generate(prompts, GREEDY)]
    llm = make_llm(loaded, draft(short_draft))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert llm.engine.stats().spec_proposed_tokens > 0 and llm.engine.proposer.num_used_blocks == 0


def test_greedy_draft_model_speculation_gives_the_same_tokens(loaded, draft_loaded, reference):
    for draft_model in (draft_loaded, loaded):  # a poor draft, and a perfect one (the target itself)
        llm = make_llm(loaded, draft(draft_model))
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0 and llm.engine.proposer.num_used_blocks == 0
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens > 0  # the target drafting itself


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_preemption_and_chunked_prefill_with_speculation_give_the_same_tokens(
    loaded, draft_loaded, reference, method
):
    spec = ngram() if method == "ngram" else draft(draft_loaded)
    # 20 blocks of 4 slots hold one request (up to 74 tokens), far from all four at once
    llm = make_llm(loaded, spec, num_kv_blocks=20, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0 and stats.kv_blocks_used == 0
    llm = make_llm(loaded, spec, max_num_batched_tokens=5)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_prefix_cache_holds_only_blocks_of_real_tokens(loaded):
    llm = make_llm(loaded, ngram())
    outs = llm.generate(PROMPTS, GREEDY)
    bm = llm.engine.block_manager
    real = set()
    for o in outs:
        tokens, parent = o.prompt_token_ids + o.token_ids, None
        for i in range(len(tokens) // bm.block_size):
            parent = block_hash(parent, tuple(tokens[i * bm.block_size : (i + 1) * bm.block_size]))
            real.add(parent)
    assert bm.hash_to_block and set(bm.hash_to_block) <= real
    assert llm.engine.stats().spec_proposed_tokens > llm.engine.stats().spec_accepted_tokens  # some rejected


def speculated_runs(loaded, prompt, params, spec):
    """Per step, the tokens a speculating engine emitted for one request."""
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, block_size=4, speculative=spec), loaded=loaded)
    engine.add_request("r", prompt, params)
    runs, seen = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            runs.append(out.token_ids[seen:])
            seen = len(out.token_ids)
    return runs


@pytest.fixture(scope="module")
def mid_run(loaded, reference):
    """(prompt index, output index i, token) with output token i emitted inside a run of accepted
    proposals (not the run's last token) and not seen earlier in the output."""
    for p, prompt in enumerate(PROMPTS):
        runs = speculated_runs(loaded, prompt, GREEDY, ngram())
        assert sum(runs, []) == reference[p]
        i = 0
        for run in runs:
            for j, token in enumerate(run[:-1]):
                if token not in reference[p][: i + j] and i + j > 1:
                    return p, i + j, token
            i += len(run)
    pytest.fail("no token emitted inside a speculated run")


def test_eos_inside_a_speculated_run_ends_the_request_there(loaded, mid_run):
    p, i, token = mid_run

    class Tokenizer(ToyTokenizer):
        eos_token_ids = [token]

    custom = LoadedModel(model=loaded.model, tokenizer=Tokenizer(), config=loaded.config)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = make_llm(custom).generate(PROMPTS[p], params)[0]
    spec = make_llm(custom, ngram()).generate(PROMPTS[p], params)[0]
    assert plain.token_ids == spec.token_ids and len(spec.token_ids) == i + 1
    assert spec.finish_reason == plain.finish_reason == "stop" and spec.text == plain.text


def test_stop_token_stop_string_and_max_tokens_inside_a_speculated_run(loaded, reference, mid_run):
    p, i, token = mid_run
    full_text = loaded.tokenizer.decode(reference[p])
    stop = full_text[i - 1 : i + 1]  # completed by output token i
    cases = [
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop_token_ids=[token]),
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=i + 1, temperature=0.0, ignore_eos=True),
    ]
    for params in cases:
        plain = make_llm(loaded).generate(PROMPTS[p], params)[0]
        spec = make_llm(loaded, ngram()).generate(PROMPTS[p], params)[0]
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.finish_reason == plain.finish_reason
        assert len(spec.token_ids) <= i + 1
    assert (
        make_llm(loaded, ngram()).generate(PROMPTS[p], cases[1])[0].text == full_text[: full_text.index(stop)]
    )


def test_greedy_logprobs_with_speculation_match_decoding_one_token_at_a_time(loaded):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = make_llm(loaded).generate(PROMPTS[0], params)[0]
    spec = make_llm(loaded, ngram()).generate(PROMPTS[0], params)[0]
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == 12
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_with_speculation_reproduces_whatever_else_runs(loaded, draft_loaded, method):
    spec = ngram() if method == "ngram" else draft(draft_loaded)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    alone = make_llm(loaded, spec).generate(PROMPTS[0], params)[0].token_ids
    mixed = make_llm(loaded, spec).generate(
        [PROMPTS[1], PROMPTS[0], "more"], [SamplingParams(temperature=1.0), params, params]
    )
    assert mixed[1].token_ids == alone and len(alone) == 16


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_speculation_gives_the_tokens_of_plain_seeded_sampling_whatever_the_budget(
    loaded, draft_loaded, method
):
    """A 16-token budget shared with 3 other requests changes how many proposals the seeded request
    gets each step. Its random draws used to depend on that count, so its tokens changed with the
    batch. Now each output position has its own noise and a proposal is accepted when it equals the
    target's own sample there: the tokens are plain seeded sampling's, alone or batched."""
    spec = ngram() if method == "ngram" else draft(draft_loaded, k=4)
    seeded = SamplingParams(max_tokens=24, temperature=0.7, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=24, temperature=0.7, ignore_eos=True)
    prompt = "abcabcabcabcab"

    def run(spec, others):
        llm = make_llm(loaded, spec, num_kv_blocks=1024, max_num_batched_tokens=16)
        return llm.generate([prompt] * (others + 1), [other] * others + [seeded])[-1].token_ids

    plain = run(None, 0)
    assert run(spec, 0) == plain and run(spec, 3) == plain and len(plain) == 24


def test_speculative_config_rejects_bad_settings(loaded):
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="vocabulary"):
        bad = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=7)))
        make_llm(loaded, SpeculativeConfig(method="draft", draft_model=bad))


def test_blocks_of_rejected_proposals_are_released_after_every_step(loaded):
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, block_size=4, speculative=ngram(6)), loaded=loaded)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    rejected = 0
    while engine.has_unfinished_requests():
        before = engine.stats()
        engine.step()
        after = engine.stats()
        rejected += (after.spec_proposed_tokens - before.spec_proposed_tokens) - (
            after.spec_accepted_tokens - before.spec_accepted_tokens
        )
        for seq in engine.scheduler.running:  # blocks cover the computed tokens and the next one only
            assert (
                -(-seq.num_computed_tokens // 4)
                <= len(seq.block_table)
                <= -(-(seq.num_computed_tokens + 1) // 4)
            )
            assert (
                seq.num_computed_tokens == seq.num_tokens - 1
                or seq.num_computed_tokens < seq.num_prompt_tokens
            )
    assert rejected > 0 and engine.stats().kv_blocks_used == 0


def test_an_aborted_requests_draft_blocks_are_freed_at_once(loaded, draft_loaded):
    engine = LLMEngine(
        EngineConfig(num_kv_blocks=64, block_size=4, speculative=draft(draft_loaded)), loaded=loaded
    )
    engine.add_request(
        "a", list(range(2, 30)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    assert engine.proposer.num_used_blocks > 0
    engine.abort_request("a")
    assert engine.proposer.num_used_blocks == 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_proposal_slots_cost_a_later_request_at_most_one_cached_block(loaded, draft_loaded, method):
    """8 blocks of 4: A's and D's prompts (9 tokens) finished, 2 cached blocks each (A's released first);
    R (14 tokens) fills the 4 plain free blocks, and its first decode's k=4 guesses need a fifth: they
    evict A's last cached block (the LRU one), so B, arriving with A's prompt, reuses 4 tokens where it
    reuses 8 without speculation; tokens and block accounting are unchanged."""
    prompt_a, prompt_r = list(range(20, 29)), [5, 6, 7] * 4 + [5, 6]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    params_r = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(spec):
        engine = LLMEngine(EngineConfig(num_kv_blocks=8, block_size=4, speculative=spec), loaded=loaded)
        finished = {}

        def drain():
            while engine.has_unfinished_requests():
                finished.update((o.request_id, o) for o in engine.step() if o.finished)

        engine.add_request("a", prompt_a, one)
        drain()
        engine.add_request("d", list(range(40, 49)), one)
        drain()
        engine.add_request("r", prompt_r, params_r)
        engine.step()  # R's prefill
        engine.step()  # R's first decode, with proposal slots
        engine.add_request("b", prompt_a, one)
        drain()
        assert engine.stats().kv_blocks_used == 0
        return finished, engine.stats()

    plain, _ = run(None)
    speculated, stats = run(ngram(4) if method == "ngram" else draft(draft_loaded, k=4))
    assert stats.spec_proposed_tokens > 0
    assert [speculated[r].token_ids for r in "abdr"] == [plain[r].token_ids for r in "abdr"]
    assert plain["b"].num_cached_tokens == 8 and speculated["b"].num_cached_tokens == 4
