"""`kiln bench engine --vllm-python`: the job reaches vLLM's interpreter and its rows come back as
Results. A stand-in `vllm` package (tmp_path) records what the worker asked of it, so this runs
without vLLM; the real runs are in bench/results/2026-11-24-cpu-engine-peers-*.json."""

import argparse
import json
import sys
import textwrap

import pytest

from kiln.bench import engine as benchmark
from kiln.bench import engine_vllm

FAKE_VLLM = """
import json, os, time

__version__ = "0.0-fake"

class _Out:
    def __init__(self, n):
        self.token_ids = list(range(n))

class _Request:
    def __init__(self, n):
        self.outputs = [_Out(n)]

class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens

class LLM:
    def __init__(self, **kwargs):
        self.log = open(os.environ["FAKE_VLLM_LOG"], "a")
        self.log.write(json.dumps({"init": kwargs}) + "\\n")

    def generate(self, prompts, params, use_tqdm=True):
        ids = [p["prompt_token_ids"] for p in prompts]
        if params.max_tokens == 1:  # a TTFT call: prompt i of the job takes 0.05 * i seconds
            time.sleep(0.05 * (ids[0][0] % 10))
        self.log.write(json.dumps({"prompts": ids, "max_tokens": params.max_tokens}) + "\\n")
        self.log.flush()
        return [_Request(params.max_tokens) for _ in prompts]
"""


def argparse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return log


def test_worker_runs_each_concurrency_after_a_warm_up_then_the_ttft_prompts(fake_vllm, tmp_path):
    model = tmp_path / "hf"
    model.mkdir()
    runs = {1: [[101, 102, 103]], 4: [[200 + i] * 5 for i in range(4)]}
    ttft = [[300, 301], [400, 401], [500, 501]]
    rows = engine_vllm.run_vllm(sys.executable, str(model), runs, 6, ttft)
    assert [(r["scenario"], r.get("concurrency"), r.get("output_tokens")) for r in rows] == [
        ("single-stream", 1, 6),
        ("concurrent", 4, 24),
        ("ttft", None, None),
    ]
    assert len(rows[2]["seconds"]) == 3 and all(s >= 0 for s in rows[2]["seconds"])
    calls = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    init = calls[0]["init"]
    assert init["model"] == str(model) and init["max_num_seqs"] == 4 and init["dtype"] == "bfloat16"
    assert init["max_model_len"] >= 5 + 6
    timed = [c["prompts"] for c in calls[1:] if "prompts" in c]
    # a warm-up batch of the same size on other tokens before each timed one, then one call per TTFT prompt
    assert timed[1] == runs[1] and timed[3] == runs[4] and timed[4:] == [[p] for p in ttft]
    assert len(timed[0]) == 1 and timed[0] != runs[1] and len(timed[2]) == 4 and timed[2] != runs[4]


def test_bench_vllm_turns_rows_into_results_and_drops_the_first_ttft(fake_vllm, tmp_path, monkeypatch):
    model = tmp_path / "hf"
    model.mkdir()
    args = argparse_args(["--max-tokens", "3", "--prompt-len", "4", "--ttft-prompt-len", "7"])
    args.vllm_python = sys.executable
    # TTFT prompt i starts with token 10 * k + i, which the fake sleeps 0.05 * i seconds on
    prompts = [[10 * 20 + i] * 7 for i in range(1 + args.ttft_repeats)]
    monkeypatch.setattr(benchmark, "_ttft_prompts", lambda args, vocab: prompts)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    peers = {}
    results = benchmark.bench_vllm(args, str(model), vocab=1000, concurrencies=[1, 2], info=peers)
    assert [(r.system, r.scenario, r.concurrency, r.output_tokens) for r in results] == [
        ("vllm", "single-stream", 1, 3),
        ("vllm", "concurrent", 2, 6),
        ("vllm", "ttft", 1, 1),
    ]
    calls = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    ttft_calls = [c for c in calls if c.get("max_tokens") == 1]
    assert len(ttft_calls) == 1 + args.ttft_repeats and all(len(c["prompts"][0]) == 7 for c in ttft_calls)
    # the untimed first prompt (0 s) is dropped: the median of 0.05, 0.10, 0.15 s
    assert 0.09 < results[2].seconds < 0.2 and results[2].ttft_ms == 1e3 * results[2].seconds
    # every core for vLLM's threads (its default reserves one), and a bounded KV cache
    assert peers["vllm"]["version"] == "0.0-fake"
    assert peers["vllm"]["env"] == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_a_failing_interpreter_is_named_with_its_output(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such interpreter"):
        engine_vllm.run_vllm(str(tmp_path / "nope"), str(tmp_path), {1: [[1]]}, 2, [])
    # no vllm importable: the worker dies, and the error names the interpreter and shows the traceback
    with pytest.raises(RuntimeError, match="vLLM worker .* exited with 1(.|\n)*ModuleNotFoundError"):
        engine_vllm.run_vllm(sys.executable, str(tmp_path), {1: [[1]]}, 2, [])
