"""Engine decode steps on the CPU with a float32, bfloat16 and float16 KV cache: the embedded SmolLM2
GGUF (Kiln's default formats), `--sequences` random prompts of `--prompt-len` tokens, `--max-tokens`
greedy tokens each, every `LLMEngine.step` timed; the median decode step (steps after the prefill)
per cache dtype, the dtypes interleaved over `--rounds`. Prints one JSON object with the CPU model and
ISA flags (kiln.environment.cpu), and whether each dtype's greedy tokens equal float32's.

    OMP_NUM_THREADS=2 python scripts/cpu_kv_dtype_steps.py [--sequences 16] [--prompt-len 32]
        [--max-tokens 128] [--rounds 2]
    OMP_NUM_THREADS=2 python scripts/cpu_kv_dtype_steps.py --sequences 1 --prompt-len 2000 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics

from kiln import environment
from kiln.bench.engine import _prompts, decode_step_seconds
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.loaders import default_model_path, load_model

DTYPES = ("auto", "bfloat16", "float16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    path = default_model_path()
    # a model each: a model holds the flat decode loop of the last engine built on it (its KV caches)
    engines = {
        dtype: LLMEngine(
            EngineConfig(model=path, device="cpu", max_num_seqs=args.sequences, kv_cache_dtype=dtype),
            loaded=load_model(path, device="cpu"),
        )
        for dtype in DTYPES
    }
    vocab = engines["auto"].model.config.vocab_size
    prompts = _prompts(args.sequences, args.prompt_len, vocab, seed=2)
    steps = {dtype: [] for dtype in DTYPES}
    tokens = {}
    for engine in engines.values():  # warm-up: each engine's buffers and kernels
        decode_step_seconds(engine, _prompts(args.sequences, args.prompt_len, vocab, seed=1), 4, "warmup")
    for r in range(args.rounds):
        for dtype, engine in engines.items():
            seconds, tokens[dtype] = decode_step_seconds(engine, prompts, args.max_tokens, f"r{r}")
            steps[dtype] += seconds
    result = {
        "environment": environment.cpu(),
        "model": path,
        "sequences": args.sequences,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "median_decode_step_ms": {d: 1e3 * statistics.median(s) for d, s in steps.items()},
        "tokens_equal_float32": {d: tokens[d] == tokens["auto"] for d in DTYPES[1:]},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
