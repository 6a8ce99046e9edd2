"""Multi-process launch through torchrun (the multi-node path, here 2 processes on loopback):
rendezvous from the standard env vars, rank 0 drives, rank 1 serves, tokens equal TP 1's."""

import os
import subprocess
import sys

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
