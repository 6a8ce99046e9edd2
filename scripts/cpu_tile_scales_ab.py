"""The Q4 tile kernel's float16 scales in the engine, A/B in one process: the embedded SmolLM2 GGUF loaded
twice with Kiln's default formats, one copy as loaded (Q4_1's d and m in the tiles as float16) and one
with every "q4_blocks_onednn" weight's tile scales widened to float32 (the layout before float16), each in
its own engine; `--sequences` prompts of 32 random tokens (seed 0), `--max-tokens` greedy tokens each,
rounds alternating between the two (order flipped every round). Prints each round's median decode-step ms
and whether both gave the same tokens (they must: the same values), as one JSON object with the CPU model
and ISA flags (kiln.environment.cpu). The tiles only run at their rows (AVX-512 builds: 8 to 64).

    OMP_NUM_THREADS=2 python scripts/cpu_tile_scales_ab.py [--sequences 8] [--rounds 6] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from kiln import environment
from kiln.bench.engine import _prompts, decode_step_seconds
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.loaders import default_model_path, load_model


def _engine(path: str, sequences: int, widen: bool) -> tuple[LLMEngine, int]:
    """An engine on a fresh load; with `widen`, the Q4 tiles' scales as float32. Also how many weights
    hold float16 tile scales as loaded."""
    loaded = load_model(path, device="cpu")
    halves = 0
    for module in loaded.model.modules():
        prepared = getattr(module, "prepared", None)
        if prepared is None or prepared.layout != "q4_blocks_onednn":
            continue
        if prepared.tensors[5].dtype != torch.float16:
            continue
        halves += 1
        if widen:
            tensors = (*prepared.tensors[:5], prepared.tensors[5].float())
            module.prepared = dataclasses.replace(prepared, tensors=tensors)
    config = EngineConfig(model=path, device="cpu", max_num_seqs=sequences)
    return LLMEngine(config, loaded=loaded), halves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each (alternating)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    path = default_model_path()
    engines, halves = {}, 0
    for name, widen in (("float16", False), ("float32", True)):
        engines[name], halves = _engine(path, args.sequences, widen)
    prompts = _prompts(args.sequences, 32, engines["float16"].model.config.vocab_size, seed=0)
    for engine in engines.values():
        decode_step_seconds(engine, prompts, 8, "warm-up")
    step_ms = {name: [] for name in engines}
    tokens = {}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            steps, tokens[name] = decode_step_seconds(engines[name], prompts, args.max_tokens, f"{name}-{r}")
            step_ms[name].append(round(statistics.median(steps) * 1e3, 3))
    result = {
        "what": "engine decode steps, Q4 tile scales float16 (as loaded) / widened to float32, medians per "
        "round (ms)",
        "environment": environment.cpu(),
        "sequences": args.sequences,
        "weights_with_float16_tile_scales": halves,
        "step_ms": step_ms,
        "median_step_ms": {name: statistics.median(v) for name, v in step_ms.items()},
        "same_tokens": tokens["float16"] == tokens["float32"],
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
