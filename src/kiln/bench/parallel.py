"""`kiln bench parallel`: decode throughput of one layout (TP / PP / EP / TP x PP) against one process,
and where each step's time goes: computing, or inside the communication.

    kiln bench parallel --tp 2 | --pp 2 | --tp 2 --pp 2 | --ep 2  [--model PATH] [--batch 8]
                        [--max-tokens 32] [--micro-batches M] [--lanes L] [--device cpu|cuda]

`--batch` greedy requests (ignore_eos) run together; tokens/s counts the tokens of the decode steps
(after every request has its first token). With pipeline lanes (`--lanes`, default --pp) a step is
one lane's: its share of the requests. Communication per decode step:
  - rank 0's wall time inside torch.distributed's all_reduce (TP: 2 per layer + the embedding),
    all_to_all_single and all_gather (EP: the token dispatch / combine), gather (the logits);
    each includes waiting for the slowest rank (load imbalance), not only the transfer;
  - pipeline stages: every rank's time blocked in its point-to-point waits (receiving hidden states,
    sending them, rank 0 receiving the logits) and computing (PipelineStageRunner.stats); a wait
    includes the pipeline bubble (waiting for the previous stage), which is the point of measuring it.
Rank 0 also spends time broadcasting each step's inputs (cpu_group), not counted here.
Prints one JSON object. On a CPU with few cores the ranks share the cores: expect a slowdown there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

PROMPT = "Explain in a few sentences why the sky is blue."
TIMED_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather", "gather")


@contextmanager
def timed_collectives():
    """Within: {name: [seconds, calls]} of this process's torch.distributed collectives in
    TIMED_COLLECTIVES (the layers look them up on the module at call time)."""
    import torch
    import torch.distributed as dist

    totals = {name: [0.0, 0] for name in TIMED_COLLECTIVES}
    originals = {name: getattr(dist, name) for name in TIMED_COLLECTIVES}

    def timed(name, fn):
        def call(*args, **kwargs):
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += 1
            return out

        return call

    for name, fn in originals.items():
        setattr(dist, name, timed(name, fn))
    try:
        yield totals
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def decode_run(engine, batch: int, max_tokens: int) -> dict:
    """Run `batch` greedy requests; tokens/s and per-step communication over the decode steps."""
    from kiln.engine.sampling_params import SamplingParams

    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{i}", prompt, params)
    stage_stats = getattr(engine, "stage_stats", None)
    with timed_collectives() as totals:
        prefilled: set[str] = set()
        while len(prefilled) < batch:  # the prefills (one step, or one per pipeline lane)
            prefilled.update(out.request_id for out in engine.step())
        for entry in totals.values():
            entry[0], entry[1] = 0.0, 0
        before = stage_stats() if stage_stats else None
        start, steps, tokens = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            tokens += len(engine.step())
            steps += 1
        elapsed = time.perf_counter() - start
        after = stage_stats() if stage_stats else None
    step_ms = 1e3 * elapsed / steps
    result = {"decode_tokens_per_s": tokens / elapsed, "decode_steps": steps, "step_ms": step_ms}
    comm_ms = 0.0
    for name, (seconds, calls) in totals.items():
        if calls:
            result[f"rank0_{name}_ms_per_step"] = 1e3 * seconds / steps
            result[f"rank0_{name}_calls_per_step"] = calls / steps
            comm_ms += 1e3 * seconds / steps
    if before is not None and after and after[0]:
        ranks = []
        for rank, (b, a) in enumerate(zip(before, after, strict=True)):
            wait = 1e3 * (a["p2p_wait_s"] - b["p2p_wait_s"]) / steps
            compute = 1e3 * (a["compute_s"] - b["compute_s"]) / steps
            ranks.append({"rank": rank, "p2p_wait_ms_per_step": wait, "compute_ms_per_step": compute})
        result["pipeline_ranks"] = ranks
        comm_ms += ranks[0]["p2p_wait_ms_per_step"]
    result["rank0_communication_ms_per_step"] = comm_ms
    result["rank0_communication_share"] = comm_ms / step_ms
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (per stage)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="pipeline micro-batches (default: 1 with lanes, else --pp)",
    )
    parser.add_argument(
        "--lanes", type=int, default=None, help="pipeline steps in flight at once (default: --pp)"
    )
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded model)")
    parser.add_argument("--batch", type=int, default=8, help="requests decoded together")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the one-process run")


def run(args: argparse.Namespace) -> int:
    import torch

    from kiln.distributed.groups import launched_by_torchrun
    from kiln.distributed.launch import parallel_ranks, start_engine
    from kiln.engine.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine
    from kiln.environment import environment

    ranks = parallel_ranks(args.tp, args.ep, args.pp)
    config = EngineConfig(
        model=args.model, device=args.device, max_num_seqs=args.batch, num_kv_blocks=64 * args.batch
    )
    layout = f"tp{args.tp}_pp{args.pp}_ep{args.ep}"
    report = {
        "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1",
        "device": str(config.resolved_device()),
        "threads_per_process": torch.get_num_threads(),
        "batch": args.batch,
    }
    # under torchrun every rank runs this command; only rank 0 reports, so only it runs the baseline
    other_rank = launched_by_torchrun() and int(os.environ["RANK"]) != 0
    if not args.no_baseline and not other_rank:
        report["one_process"] = decode_run(LLMEngine(config), args.batch, args.max_tokens)
    engine = start_engine(
        config, args.tp, ep_size=args.ep, pp_size=args.pp, micro_batches=args.micro_batches, lanes=args.lanes
    )
    if engine is None:  # a torchrun rank > 0
        return 0
    with engine:
        report[layout] = decode_run(engine, args.batch, args.max_tokens)
        report[layout]["lanes"] = engine.lanes
        report[layout]["micro_batches"] = engine.micro_batches if args.pp > 1 else None
        report[layout]["ranks"] = ranks
        report[layout]["threads_per_process"] = torch.get_num_threads()
    report["environment"] = environment()  # CPU model and ISA features, GPU, versions, commit
    print(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.bench.parallel", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
