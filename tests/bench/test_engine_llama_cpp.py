"""The llama.cpp peer runs in a child process: its result comes back, and an exception, a crash or a
hang in it becomes a RuntimeError naming what happened, which `kiln bench engine` records in the
report's peers while keeping the rows already measured."""

import argparse
import faulthandler
import math
import time

import pytest

from kiln.bench import engine as benchmark
from kiln.bench import engine_llama_cpp
from kiln.bench.engine_llama_cpp import run_in_child
from kiln.cli import main


def test_child_result_comes_back():
    assert run_in_child(math.hypot, (3.0, 4.0), "hypot") == 5.0


def test_child_exception_is_named():
    with pytest.raises(RuntimeError, match=r"sqrt failed: ValueError: math domain error"):
        run_in_child(math.sqrt, (-1.0,), "sqrt")


def test_child_crash_names_the_signal():
    with pytest.raises(RuntimeError, match=r"crasher: the process died with exit code -11"):
        run_in_child(faulthandler._sigsegv, (), "crasher")


def test_child_hang_is_killed_at_the_timeout():
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"sleeper did not finish in 2 s"):
        run_in_child(time.sleep, (60,), "sleeper", timeout=2)
    assert time.perf_counter() - start < 30


def test_llama_cpp_rows_and_peer_info_come_from_the_child_run(monkeypatch):
    run = {"tokens": 7, "seconds": 0.5, "ttft_seconds": [9.0, 0.2, 0.4, 0.3], "system_info": "AVX2 = 1"}
    monkeypatch.setattr(engine_llama_cpp, "run_llama_cpp", lambda *a, **k: {**run, "version": "0.3"})
    args = argparse.Namespace(prompt_len=5, max_tokens=7, seed=0, ttft_prompt_len=11, ttft_repeats=3)
    info = {}
    single, ttft = benchmark.bench_llama_cpp(args, "x.gguf", 1000, info)
    assert (single.system, single.scenario, single.output_tokens, single.tok_per_s) == (
        "llama-cpp",
        "single-stream",
        7,
        14.0,
    )
    assert ttft.ttft_ms == pytest.approx(300.0)  # the median of the timed ones, the first dropped
    assert info["llama_cpp"] == {"version": "0.3", "system_info": "AVX2 = 1"}


def test_a_failing_peer_is_recorded_and_leaves_the_other_rows():
    def crash():
        raise RuntimeError("llama-cpp-python on x.gguf: the process died with exit code -11")

    peers = {"vllm": {"version": "0.32"}}
    assert benchmark._peer_rows("llama_cpp", crash, peers) == []
    assert "exit code -11" in peers["llama_cpp"]["error"] and peers["vllm"] == {"version": "0.32"}


def test_missing_vllm_interpreter_fails_before_any_run(capsys):
    argv = ["bench", "engine", "--model", "random:tiny", "--vllm-python", "/no/such/python"]
    assert main(argv) == 2
    assert "no such interpreter" in capsys.readouterr().err
