"""Multi-process launch through torchrun (the multi-node path, here 2 processes on loopback):
rendezvous from the standard env vars, rank 0 drives, rank 1 serves on rank 0's device type (agreed
through the rendezvous store, whatever rank 1's machine has), tokens equal TP 1's; and `kiln bench
parallel` runs its one-process baseline on rank 0 only."""

import os
import subprocess
import sys

import pytest

from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from tests.distributed.checkpoints import write_checkpoint


def test_torchrun_two_ranks_generate_the_tp1_tokens_on_rank_0s_device(tmp_path):
    path = write_checkpoint(tmp_path, "llama", seed=3)
    single = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=16))
    single.add_request(
        "r", [5, 77, 3, 101, 42], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    while single.has_unfinished_requests():
        for out in single.step():
            expected = list(out.token_ids)
    driver = os.path.join(os.path.dirname(__file__), "torchrun_driver.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    # rank 1 is told it has a GPU: it used to pick NCCL and CUDA from that, against rank 0's gloo
    run = command + [driver, path, "--rank-1-sees-a-gpu"]
    result = subprocess.run(run, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    assert lines == ["TOKENS " + " ".join(map(str, expected))], result.stdout[-2000:]


def test_ranks_above_0_take_rank_0s_device_type_not_their_own_guess(monkeypatch):
    import torch
    import torch.distributed as dist

    from kiln.distributed.groups import agree_on_device_type

    store = dist.HashStore()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert agree_on_device_type(store, 0, "cpu") == "cpu"
    assert agree_on_device_type(store, 1, None) == "cpu"


@pytest.mark.parametrize("rank, baselines", [("0", 1), ("1", 0)])
def test_bench_parallel_under_torchrun_runs_the_baseline_on_rank_0_only(monkeypatch, rank, baselines):
    import kiln.distributed.launch
    import kiln.engine.llm_engine
    from kiln.bench import parallel

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    built = []
    monkeypatch.setattr(kiln.engine.llm_engine, "LLMEngine", lambda config: built.append(config))
    monkeypatch.setattr(parallel, "decode_run", lambda engine, batch, max_tokens: {})
    # rank 0's engine is not the point here; None = what a torchrun rank > 0 gets
    monkeypatch.setattr(kiln.distributed.launch, "start_engine", lambda *args, **kwargs: None)
    assert parallel.main(["--tp", "2", "--model", "random:tiny", "--device", "cpu"]) == 0
    assert len(built) == baselines
