"""Multi-process launch through torchrun (the multi-node path, here 2 processes on loopback):
rendezvous from the standard env vars, rank 0 drives, rank 1 serves, tokens equal TP 1's; and `kiln
bench parallel` runs its one-process baseline on rank 0 only."""

import os
import subprocess
import sys

import pytest

from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from tests.distributed.checkpoints import write_checkpoint


def test_torchrun_two_ranks_generate_the_tp1_tokens(tmp_path):
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
    result = subprocess.run(command + [driver, path], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS")]
    assert lines == ["TOKENS " + " ".join(map(str, expected))], result.stdout[-2000:]


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
