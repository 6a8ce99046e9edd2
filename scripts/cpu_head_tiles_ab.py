"""The Q8_0 LM head's tile kernel in the engine, A/B in one process: the embedded SmolLM2 GGUF (Kiln's
default formats: a "q8_blocks_onednn" head), `--sequences` prompts of 32 random tokens (seed 0),
`--max-tokens` greedy tokens each, rounds alternating between the head's tile kernel on
(native_cpu.blocks_tiles_rows("q8")) and off (its row kernel, q8_blocks_gemm), the order flipped every
round. Times each pure decode step and each LM-head call; prints the per-round medians (ms) and whether
both gave the same tokens, as one JSON object with the CPU model and ISA flags (kiln.environment.cpu). The
tiles only run at their rows (AVX-512 builds: 16 to 32 sequences).

    OMP_NUM_THREADS=2 python scripts/cpu_head_tiles_ab.py [--sequences 16] [--rounds 6] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kiln import environment
from kiln.bench.engine import _prompts, decode_step_seconds
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.loaders import default_model_path, load_model
from kiln.ops import native_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each (alternating)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    path = default_model_path()
    engine = LLMEngine(
        EngineConfig(model=path, device="cpu", max_num_seqs=args.sequences),
        loaded=load_model(path, device="cpu"),
    )
    (head,) = [m for name, m in engine.model.named_modules() if name.split(".")[-1] == "lm_head"]
    head_seconds: list[float] = []
    forward = head.forward

    def timed(*a, **kw):
        start = time.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            head_seconds.append(time.perf_counter() - start)

    head.forward = timed
    prompts = _prompts(args.sequences, 32, engine.model.config.vocab_size, seed=0)
    tiles_on = dict(native_cpu._state["tiles_rows"])
    settings = {"tiles": tiles_on, "row kernel": {**tiles_on, "q8": (0, 0)}}
    step_ms = {name: [] for name in settings}
    head_ms = {name: [] for name in settings}
    tokens = {}
    decode_step_seconds(engine, prompts, 8, "warm-up")
    try:
        for r in range(args.rounds):
            for name in list(settings) if r % 2 == 0 else list(settings)[::-1]:
                native_cpu._state["tiles_rows"] = settings[name]
                head_seconds.clear()
                steps, tokens[name] = decode_step_seconds(engine, prompts, args.max_tokens, f"{name}-{r}")
                step_ms[name].append(round(statistics.median(steps) * 1e3, 3))
                head_ms[name].append(round(statistics.median(head_seconds) * 1e3, 3))
    finally:
        native_cpu._state["tiles_rows"] = tiles_on
    result = {
        "what": "engine decode steps with the Q8_0 LM head's tile kernel on / off, medians per round (ms)",
        "environment": environment.cpu(),
        "sequences": args.sequences,
        "head_layout": head.prepared.layout,
        "tiles_rows_q8": list(tiles_on.get("q8", (0, 0))),
        "step_ms": step_ms,
        "head_ms": head_ms,
        "median_step_ms": {name: statistics.median(v) for name, v in step_ms.items()},
        "median_head_ms": {name: statistics.median(v) for name, v in head_ms.items()},
        "same_tokens": tokens["tiles"] == tokens["row kernel"],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
