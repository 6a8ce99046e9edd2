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
import time

from kiln import environment
from kiln.bench.engine import _prompts
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from kiln.loaders import default_model_path, load_model

DTYPES = ("auto", "bfloat16", "float16")


def decode_steps(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[float], list]:
    """Seconds of each decode step (prefill steps left out) and the finished token ids, by request."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps, tokens, produced = [], {}, 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        now = sum(len(o.token_ids) for o in outputs)
        if produced >= len(prompts):  # every sequence has its first token: a pure decode step
            steps.append(seconds)
        produced = max(produced, now)
        tokens.update({o.request_id: o.token_ids for o in outputs if o.finished})
    return steps, [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


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
        decode_steps(engine, _prompts(args.sequences, args.prompt_len, vocab, seed=1), 4, "warmup")
    for r in range(args.rounds):
        for dtype, engine in engines.items():
            seconds, tokens[dtype] = decode_steps(engine, prompts, args.max_tokens, f"r{r}")
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
