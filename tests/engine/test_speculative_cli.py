"""Speculative decoding from the command line and the server: `kiln generate --speculative ngram`
prints the same text as without and the acceptance line; `kiln serve`'s flags build the
SpeculativeConfig; /metrics exports proposed / accepted tokens and the acceptance rate (toy model)."""

import re

import pytest

import kiln.loaders
from kiln.cli import build_parser
from kiln.engine import EngineConfig, LLMEngine
from kiln.engine.speculative import SpeculativeConfig
from kiln.engine.speculative.args import speculative_config_from_args

from .toy_model import toy_loaded

PROMPT = "abcabcabcabc"


@pytest.fixture
def toy_loader(monkeypatch):
    loaded = toy_loaded()
    monkeypatch.setattr(kiln.loaders, "load_model", lambda *a, **k: loaded)
    return loaded


def generate(argv, capsys) -> tuple[str, list[str]]:
    args = build_parser().parse_args(
        ["generate", PROMPT, "--max-tokens", "24", "--ignore-eos", "--device", "cpu", *argv]
    )
    assert args.func(args) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    stats = [line for line in lines if line.startswith("--- ")]
    return "\n".join(line for line in lines if not line.startswith("--- ")), stats


def test_generate_with_ngram_speculation_prints_the_same_text_and_the_acceptance(toy_loader, capsys):
    plain, _ = generate([], capsys)
    spec, stats = generate(["--speculative", "ngram", "--num-speculative-tokens", "3"], capsys)
    assert spec == plain and len(plain) > 0
    match = re.search(r"speculative \(ngram, k=3\): (\d+)/(\d+) proposed tokens accepted", stats[-1])
    assert match and 0 < int(match[1]) <= int(match[2])


def test_speculative_flags_build_the_config_and_bad_ones_exit_2(toy_loader, capsys):
    args = build_parser().parse_args(
        ["serve", "--speculative", "draft", "--draft-model", "x.gguf", "--num-speculative-tokens", "2"]
    )
    assert speculative_config_from_args(args) == SpeculativeConfig(
        method="draft", draft_model="x.gguf", num_speculative_tokens=2
    )
    assert speculative_config_from_args(build_parser().parse_args(["serve"])) is None
    for argv in (["--draft-model", "x.gguf"], ["--speculative", "ngram", "--num-speculative-tokens", "0"]):
        args = build_parser().parse_args(["serve", *argv])
        assert args.func(args) == 2
        assert "kiln serve:" in capsys.readouterr().err


def test_metrics_report_proposed_and_accepted_tokens_and_the_acceptance_rate():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from kiln.server.app import create_app
    from kiln.server.launch import ServerThread

    config = EngineConfig(
        num_kv_blocks=128, block_size=4, speculative=SpeculativeConfig(num_speculative_tokens=3)
    )
    engine = LLMEngine(config, loaded=toy_loaded())
    server = ServerThread(create_app(engine, model_name="toy")).start()
    try:
        body = {"model": "toy", "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()
    values = {m[0]: float(m[1]) for m in re.findall(r"^(kiln_spec_decode_\w+) ([0-9.e+-]+)$", metrics, re.M)}
    proposed, accepted = (
        values["kiln_spec_decode_proposed_tokens_total"],
        values["kiln_spec_decode_accepted_tokens_total"],
    )
    assert 0 < accepted <= proposed
    assert values["kiln_spec_decode_acceptance_rate"] == pytest.approx(accepted / proposed)


def test_bench_engine_speculative_reports_both_runs_the_speedup_and_the_acceptance():
    import argparse

    from kiln.bench import engine as benchmark
    from kiln.bench.engine_speculative import bench_speculative

    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    args = parser.parse_args(["--speculative", "ngram", "--max-tokens", "12", "--spec-repeats", "1"])
    rows, summary = bench_speculative(args, toy_loaded(), "toy", "cpu")
    results = [benchmark.Result(**row) for row in rows]
    assert [r.system for r in results] == ["kiln", "kiln-spec-ngram"]
    assert results[0].output_tokens == results[1].output_tokens > 0  # greedy: the same tokens
    assert summary["spec_outputs_identical"] is True
    assert summary["spec_speedup"] == pytest.approx(results[1].tok_per_s / results[0].tok_per_s)
    assert summary["spec_acceptance_rate"] == pytest.approx(
        summary["spec_accepted_tokens"] / summary["spec_proposed_tokens"]
    )
