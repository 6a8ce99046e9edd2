"""Penalties, logit_bias and min_tokens through the engine: greedy tokens equal transformers' `generate`
with repetition_penalty / sequence_bias / min_new_tokens on a tiny random Qwen2 checkpoint (batched
with plain requests); min_tokens holds off EOS, stop tokens and stop strings; a request that adjusts
its logits is never speculated."""

from __future__ import annotations

import pytest
import torch

from kiln.engine import LLM, SamplingParams
from kiln.engine.logits_processors import bad_words_token_ids
from kiln.engine.speculative import SpeculativeConfig
from kiln.loaders import load_model
from tests.models.test_llama_family_hf import _qwen2, _randomize, _write_tokenizer

from .toy_model import EOS, toy_loaded

transformers = pytest.importorskip("transformers")

ALLOWED = [11, 42, 64, 90, 127]
PROMPTS = [[5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 17, 90], [8, 8, 8, 60, 61, 8, 8], [100, 7]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    hf = _qwen2()
    _randomize(hf, seed=4)
    hf.eval().save_pretrained(path)
    _write_tokenizer(path)
    return hf, load_model(str(path))


def _hf_greedy(hf, prompt: list[int], max_tokens: int, eos: int, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_with_penalties_bias_and_min_tokens_equal_transformers(checkpoint):
    hf, loaded = checkpoint
    eos = loaded.tokenizer.eos_token_ids[0]
    llm = LLM(loaded=loaded, num_kv_blocks=64, block_size=8)
    cases = [
        (dict(repetition_penalty=1.6), dict(repetition_penalty=1.6)),
        (dict(repetition_penalty=0.6), dict(repetition_penalty=0.6)),
        (dict(logit_bias={11: 6.0, 64: -100.0}), dict(sequence_bias={(11,): 6.0, (64,): -100.0})),
        # EOS strongly favored: it ends the output right at min_tokens
        (dict(logit_bias={eos: 100.0}, min_tokens=5), dict(sequence_bias={(eos,): 100.0}, min_new_tokens=5)),
        (dict(min_tokens=12, repetition_penalty=1.2), dict(min_new_tokens=12, repetition_penalty=1.2)),
        # transformers has no allow-list: it suppresses every other token
        (dict(allowed_token_ids=ALLOWED), dict(suppress_tokens=sorted(set(range(128)) - set(ALLOWED)))),
    ]  # fmt: skip
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    for ours, theirs in cases:
        params = SamplingParams(max_tokens=12, temperature=0.0, **ours)
        # each prompt with the case's params, batched with the same prompts without them
        outs = llm.generate(PROMPTS + PROMPTS, [params] * len(PROMPTS) + [plain] * len(PROMPTS))
        for prompt, out, base in zip(PROMPTS, outs[: len(PROMPTS)], outs[len(PROMPTS) :], strict=True):
            assert out.token_ids == _hf_greedy(hf, prompt, 12, eos, **theirs), (ours, prompt)
            assert base.token_ids == _hf_greedy(hf, prompt, 12, eos), prompt
    # the penalties changed something, or the comparison above proves little
    changed = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.6))
    assert [o.token_ids for o in changed] != [o.token_ids for o in llm.generate(PROMPTS, plain)]
    ended = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, **cases[3][0]))[0]
    assert len(ended.token_ids) == 6 and ended.token_ids[-1] == eos and ended.finish_reason == "stop"
    allowed = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=ALLOWED))
    assert all(set(o.token_ids) <= set(ALLOWED) for o in allowed)


def test_token_ids_outside_the_vocabulary_or_an_impossible_allow_list_are_refused(checkpoint):
    llm = LLM(loaded=checkpoint[1], num_kv_blocks=64, block_size=8)
    eos = llm.tokenizer.eos_token_ids[0]
    for params, message in (
        (SamplingParams(logit_bias={128: 1.0}), "logit_bias token id 128"),
        (SamplingParams(allowed_token_ids=[5, 128]), "allowed_token_ids token id 128"),
        (SamplingParams(stop_token_ids=[7, 200]), "stop_token_ids token id 200"),
        (SamplingParams(allowed_token_ids=[eos], min_tokens=2), "no token could be sampled"),
    ):
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[0], params)
    assert llm.engine.stats().kv_blocks_used == 0 and not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def toy():
    return toy_loaded()


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(toy):
    llm = LLM(loaded=toy, num_kv_blocks=64, block_size=4)
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    base = llm.generate("hello world", SamplingParams(**greedy))[0]
    first, text = base.token_ids[0], base.text
    assert len(text) == 12  # the toy's tokens are one character each
    # the first output token as a stop token ends the request at once, unless min_tokens holds it off
    out = llm.generate("hello world", SamplingParams(**greedy, stop_token_ids=[first]))[0]
    assert out.token_ids == [first]
    out = llm.generate("hello world", SamplingParams(**greedy, stop_token_ids=[first], min_tokens=4))[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:4]
    # stop strings: searched from the min_tokens-th token on, as vLLM does: a match may start in the
    # text before it and end in it (the search then starts len(stop) - 1 characters back)
    for stop in (text[:2], text[7:9], text[3:6]):
        for min_tokens in (0, 3, 9, 10, 12):
            params = SamplingParams(**greedy, stop=[stop], min_tokens=min_tokens)
            out = llm.generate("hello world", params)[0]
            hit = text.find(stop, max(0, min_tokens - len(stop)))
            assert out.text == (text if hit < 0 else text[:hit]), (stop, min_tokens)
            assert len(out.token_ids) >= min_tokens
    # EOS as well: favored by +100, it comes right at min_tokens
    eos_first = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={EOS: 100.0}, min_tokens=7)
    out = llm.generate("hello world", eos_first)[0]
    assert len(out.token_ids) == 8 and out.token_ids[-1] == EOS and out.finish_reason == "stop"


def test_a_request_with_penalties_is_not_speculated_and_decodes_as_without_speculation(toy):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)
    prompts = ["abcabcabcabc", "hello world, hello world, hello"]
    penalized = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=2.0)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reference = LLM(loaded=toy, num_kv_blocks=128, block_size=4).generate(prompts, penalized)
    llm = LLM(loaded=toy, num_kv_blocks=128, block_size=4, speculative=spec)
    outs = llm.generate(prompts, penalized)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert llm.engine.spec_proposed_tokens == 0
    llm.generate(prompts, plain)  # the same engine speculates for plain requests
    assert llm.engine.spec_proposed_tokens > 0


def test_bad_words_decode_as_transformers_bad_words_ids(checkpoint):
    """Greedy decoding with bad words made of the plain output's tokens (a one-token word and a
    two-token one, as text) equals transformers' generate(bad_words_ids=their token ids). (This byte-level
    tokenizer has no merges, so no word gains a spaced form: tests/server/test_openai_smollm2.py checks
    that rule on SmolLM2's.)"""
    hf, loaded = checkpoint
    tokenizer = loaded.tokenizer
    eos = tokenizer.eos_token_ids[0]
    llm = LLM(loaded=loaded, num_kv_blocks=64, block_size=8)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tested = 0
    for prompt in PROMPTS:
        base = llm.generate(prompt, plain)[0].token_ids
        # output tokens that are their own text's encoding (printable characters)
        own = [
            i
            for i, t in enumerate(base)
            if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
        ]
        pairs = [i for i in own if i + 1 in own and i > 0 and base[i] != prompt[-1]]
        if len(own) < 2 or not pairs:
            continue
        words = [tokenizer.decode([base[own[0]]]), tokenizer.decode(base[pairs[0] : pairs[0] + 2])]
        ids = bad_words_token_ids(tokenizer, words, 128)
        assert ids == [[base[own[0]]], base[pairs[0] : pairs[0] + 2]]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=words)
        out = llm.generate(prompt, params)[0].token_ids
        assert out != base and base[own[0]] not in out
        assert out == _hf_greedy(hf, prompt, 12, eos, bad_words_ids=ids, min_new_tokens=12), (prompt, words)
        tested += 1
    assert tested >= 2
    with pytest.raises(ValueError, match="bad_words token id 222"):  # " x": the space token is 222
        llm.generate(PROMPTS[0], SamplingParams(bad_words=["a b"]))
