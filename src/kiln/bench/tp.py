"""`kiln bench tp`: decode speed of TP 1 vs TP N, and the all-reduce time per decode step on rank 0.

    kiln bench tp --tp 2 [--model PATH] [--max-tokens 64] [--device cpu|cuda]

One greedy request (ignore_eos) per engine: tokens/s over the decode steps (after the first token),
and for TP N the time rank 0 spends inside all_reduce per decode step (2 per layer + 1 for the
embedding; it includes waiting for the slowest rank, i.e. load imbalance, not only the transfer).
Prints one JSON object. On a CPU with few cores the ranks share the cores, so expect no speed-up
there; the comparison that matters is on GPUs (NCCL, one GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPT = "Explain in a few sentences why the sky is blue."


def decode_rate(engine, max_tokens: int, timed: bool) -> dict:
    """Greedy decode of one request; tokens/s after the first token (+ all-reduce time when timed)."""
    from kiln.engine.sampling_params import SamplingParams
    from kiln.models.layers.tp import time_all_reduces

    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    engine.add_request(
        "bench", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    first = None
    steps = 0
    with time_all_reduces() as timer:
        while engine.has_unfinished_requests():
            engine.step()
            if first is None:
                first = time.perf_counter()
                timer.seconds, timer.calls = 0.0, 0  # count decode steps only
            else:
                steps += 1
    elapsed = time.perf_counter() - first
    result = {"decode_tokens_per_s": steps / elapsed, "decode_steps": steps, "step_ms": 1e3 * elapsed / steps}
    if timed:
        result["all_reduce_ms_per_step"] = 1e3 * timer.seconds / steps
        result["all_reduces_per_step"] = timer.calls / steps
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks to compare with TP 1")
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded model)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens of the one request")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")


def run(args: argparse.Namespace) -> int:
    import torch

    from kiln.distributed.engine import TensorParallelEngine
    from kiln.engine.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine

    config = EngineConfig(model=args.model, device=args.device, max_num_seqs=1, num_kv_blocks=256)
    report = {
        "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
        "device": str(config.resolved_device()),
    }
    single = LLMEngine(config)
    report["tp1"] = decode_rate(single, args.max_tokens, timed=False)
    if config.resolved_device().type == "cpu":
        # each TP rank gets cores / tp threads; TP 1 on the same thread count separates the effect of
        # the split from that of OpenMP threading on a busy machine
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads // args.tp))
        report["tp1"]["threads"] = threads
        report[f"tp1_{torch.get_num_threads()}_threads"] = decode_rate(single, args.max_tokens, timed=False)
        torch.set_num_threads(threads)
    del single
    with TensorParallelEngine(config, tp_size=args.tp) as engine:
        report[f"tp{args.tp}"] = decode_rate(engine, args.max_tokens, timed=True)
    print(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.bench.tp", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
