"""`kiln bench engine`: the engine runs measure every concurrency and summarize (the toy model), the
--decode-loop mode times one token per step through the model alone, and a whole run writes the
JSON report with the benchmark's own options only (a random-weight tiny Llama, no baselines)."""

import argparse
import json

import pytest
import torch
from engine.toy_model import toy_loaded  # tests/engine/toy_model.py

from kiln.bench import engine as benchmark
from kiln.cli import main
from kiln.loaders import load_model
from kiln.models.cpu_flat_decode import FlatDecodeLayers
from kiln.ops import native_cpu


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    return parser.parse_args(argv)


def test_engine_benchmark_measures_every_concurrency_and_summarizes():
    args = _args(["--max-tokens", "5", "--prompt-len", "7", "--concurrency", "1,3", "--num-prompts", "4"])
    args.ttft_prompt_len, args.ttft_repeats = 9, 2
    results = benchmark.bench_kiln(args, toy_loaded(), [1, 3])
    assert [(r.scenario, r.concurrency, r.output_tokens) for r in results] == [
        ("single-stream", 1, 5),
        ("concurrent", 3, 15),
        ("ttft", 1, 1),
        ("offline", 4, 20),
    ]
    runs = [r for r in results if r.scenario != "ttft"]
    assert all(r.tok_per_s > 0 and r.ttft_ms > 0 and r.tpot_ms > 0 for r in runs)
    ttft = results[2]  # the median of 2 timed prompts; tok/s is prompt tokens per second of it
    assert ttft.ttft_ms == 1e3 * ttft.seconds > 0 and abs(ttft.tok_per_s - 9 / ttft.seconds) < 1e-6
    table = benchmark.markdown(results)
    assert table.count("\n") == len(results) + 1 and "| kiln | concurrent | 3 | 15 |" in table
    summary = benchmark.comparisons(results)
    assert summary["single_stream_tok_s"] == results[0].tok_per_s


def test_decode_loop_prefills_once_then_decodes_one_token_per_step():
    loaded = load_model("random:tiny", device="cpu")
    tokens_per_forward = []
    loaded.model.register_forward_hook(lambda module, args, output: tokens_per_forward.append(len(args[0])))
    prompt = list(range(100, 111))
    flat_steps, flat_call = [], FlatDecodeLayers.__call__

    def counting(flat, *args):  # the one-token steps the flat loop takes
        flat_steps.append(args[1].shape[0])
        return flat_call(flat, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FlatDecodeLayers, "__call__", counting)
        wall_tok_s, cpu_tok_s = benchmark.decode_tokens_per_second(loaded.model, prompt, steps=6)
    # the prompt in one forward, 4 warm-up steps, then the 6 timed ones
    assert tokens_per_forward == [len(prompt)] + [1] * (4 + 6)
    assert wall_tok_s > 0 and cpu_tok_s > 0
    # the one-token steps ran as the engine's runner runs them: flat (where the native library is built)
    assert len(flat_steps) == (10 if native_cpu.load() else 0) and loaded.model.flat_decode is None


def test_decode_loop_mode_writes_one_result_and_its_summary(tmp_path):
    out = tmp_path / "decode.json"
    argv = ["bench", "engine", "--model", "random:tiny", "--device", "cpu", "--decode-loop"]
    assert main([*argv, "--max-tokens", "5", "--prompt-len", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert (result["system"], result["scenario"], result["output_tokens"]) == ("kiln", "decode-loop", 5)
    assert result["tok_per_s"] == report["summary"]["decode_loop_tok_s"] > 0
    assert report["summary"]["decode_loop_cpu_ms_per_token"] > 0
    assert report["config"]["decode_loop"] is True


def test_engine_run_reports_machine_config_results_and_summary(tmp_path):
    out = tmp_path / "engine.json"
    argv = ["bench", "engine", "--model", "random:tiny", "--device", "cpu", "--concurrency", "1,2"]
    argv += ["--num-prompts", "2", "--max-tokens", "4", "--prompt-len", "8", "--hf-batches", ""]
    argv += ["--ttft-prompt-len", "0"]
    assert main([*argv, "--no-llama-cpp", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    keys = ["machine", "environment", "config", "model", "results", "summary", "kiln", "peers"]
    assert list(report) == keys and report["peers"] == {}
    # the layouts of random:tiny's 2 x 4 projections and its LM head; decode ran eagerly
    layouts = report["kiln"]["weight_layouts"]
    assert sum(layouts["layers"].values()) == 8 and layouts["lm_head"] in layouts["layers"]
    assert layouts["bytes"] > 0  # their tensors' bytes
    assert report["kiln"]["compiled_decode"] is None
    assert report["machine"]["torch_threads"] == torch.get_num_threads()
    assert {"git_commit", "cpu_model", "cpu_flags", "gpu_name"} <= report["environment"].keys()
    # the options of `kiln bench engine` only: none of the op benchmark's (`kiln bench --suite ...`)
    own = vars(_args([]))
    assert report["config"].keys() == own.keys() and report["config"]["concurrency"] == "1,2"
    scenarios = [(r["scenario"], r["concurrency"], r["output_tokens"]) for r in report["results"]]
    assert scenarios == [("single-stream", 1, 4), ("concurrent", 2, 8), ("offline", 2, 8)]
    assert report["summary"]["single_stream_tok_s"] == report["results"][0]["tok_per_s"]


def test_summary_gives_ratios_to_each_peer_and_the_targets():
    def row(system, scenario, c, tok_s, ttft_ms=None):
        return benchmark.Result(system, scenario, c, 10, 1.0, tok_s, ttft_ms)

    results = [
        row("kiln", "single-stream", 1, 60.0),
        row("kiln", "concurrent", 16, 450.0),
        row("kiln", "ttft", 1, 900.0, ttft_ms=300.0),
        row("kiln", "offline", 16, 999.0),
        row("llama-cpp", "single-stream", 1, 120.0),
        row("llama-cpp", "ttft", 1, 300.0, ttft_ms=900.0),
        row("vllm", "single-stream", 1, 40.0),
        row("vllm", "concurrent", 16, 300.0),
    ]
    summary = benchmark.comparisons(results)
    assert summary["single_stream_tok_s"] == 60.0 and summary["concurrent16_tok_s"] == 450.0
    assert summary["single_stream_vs_llama_cpp"] == 0.5 and not summary["single_stream_meets_1x_llama_cpp"]
    assert summary["single_stream_vs_vllm"] == 1.5 and summary["concurrent16_vs_vllm"] == 1.5
    assert summary["concurrent16_meets_1.5x_vllm"]
    assert abs(summary["ttft_vs_llama_cpp"] - 1 / 3) < 1e-12 and not summary["ttft_meets_0.3x_llama_cpp"]
    assert "single_stream_vs_hf" not in summary  # no HF rows in this run
