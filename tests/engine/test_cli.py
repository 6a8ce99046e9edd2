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


def test_generate_reports_a_missing_model_file_without_a_traceback(capsys):
    args = build_parser().parse_args(
        ["generate", "hi", "--model", "/nonexistent/model.gguf", "--device", "cpu"]
    )
    assert args.func(args) == 2
    assert "/nonexistent/model.gguf" in capsys.readouterr().err
