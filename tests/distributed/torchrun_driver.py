"""Run by test_torchrun.py under `torchrun --nproc-per-node 2`: every rank runs this file; rank 0
prints the greedy tokens of a TP 2 engine on the CPU, rank 1 serves it. With `--rank-1-sees-a-gpu`,
torch.cuda.is_available() says True on rank 1: it must still use rank 0's device (gloo, the CPU)."""

import os
import sys

import torch

from kiln.distributed.launch import start_engine
from kiln.engine.config import EngineConfig
from kiln.engine.sampling_params import SamplingParams

if __name__ == "__main__":
    if "--rank-1-sees-a-gpu" in sys.argv and os.environ["RANK"] == "1":
        torch.cuda.is_available = lambda: True
    engine = start_engine(EngineConfig(model=sys.argv[1], device="cpu", num_kv_blocks=16), tp_size=2)
    if engine is not None:
        engine.add_request(
            "r", [5, 77, 3, 101, 42], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        )
        tokens = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.token_ids
        engine.shutdown()
        print("TOKENS", " ".join(map(str, tokens)), flush=True)
