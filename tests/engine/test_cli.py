"""`kiln generate` streams text and ends with the TTFT / tok/s line; the engine benchmark measures
and tabulates (both driven with the toy model in place of the loader)."""

import argparse

import pytest

import kiln.loaders
from kiln.cli import build_parser
from kiln.engine import benchmark

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


def test_engine_benchmark_measures_every_concurrency_and_summarizes(toy_loader):
    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    args = parser.parse_args(
        ["--max-tokens", "5", "--prompt-len", "7", "--concurrency", "1,3", "--num-prompts", "4"]
    )
    results = benchmark.bench_kiln(args, toy_loader, [1, 3])
    assert [(r.scenario, r.concurrency, r.output_tokens) for r in results] == [
        ("single-stream", 1, 5),
        ("concurrent", 3, 15),
        ("offline", 4, 20),
    ]
    assert all(r.tok_per_s > 0 and r.ttft_ms > 0 and r.tpot_ms > 0 for r in results)
    table = benchmark.markdown(results)
    assert table.count("\n") == len(results) + 1 and "| kiln | concurrent | 3 | 15 |" in table
    summary = benchmark.comparisons(results)
    assert summary["single_stream_tok_s"] == results[0].tok_per_s


def test_generate_reports_a_missing_model_file_without_a_traceback(capsys):
    args = build_parser().parse_args(
        ["generate", "hi", "--model", "/nonexistent/model.gguf", "--device", "cpu"]
    )
    assert args.func(args) == 2
    assert "/nonexistent/model.gguf" in capsys.readouterr().err
