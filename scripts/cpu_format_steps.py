"""Engine decode steps on the CPU in several weight formats, in one process: the embedded SmolLM2 GGUF
loaded once per format (`--formats`, each a --cpu-format with `--lm-head-format`, or "default": the
loader's choice), `--sequences` random prompts of `--prompt-len` tokens, `--max-tokens` greedy tokens
each; every `LLMEngine.step` after all prefills timed, the formats interleaved over `--rounds` rounds
after one untimed. Prints one JSON object with the CPU model and ISA flags (kiln.environment.cpu) and
the median decode step per format.

    OMP_NUM_THREADS=2 python scripts/cpu_format_steps.py --formats q4_blocks_w8a8,int4_w8a8,default \
        --lm-head-format int8_blocks_w8a8 --kv-cache-dtype bfloat16 --compile-cpu-decode [--sequences 1]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="q4_blocks_w8a8,int4_w8a8,default")
    parser.add_argument("--lm-head-format", default="int8_blocks_w8a8", help="for every format but default")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--compile-cpu-decode", action="store_true")
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    path = default_model_path()
    engines = {}
    for fmt in args.formats.split(","):
        formats = {} if fmt == "default" else {"cpu_format": fmt, "lm_head_format": args.lm_head_format}
        config = EngineConfig(
            model=path, device="cpu", max_num_seqs=max(args.sequences, 1), kv_cache_dtype=args.kv_cache_dtype,
            compile_cpu_decode=args.compile_cpu_decode, **formats,
        )  # fmt: skip
        engines[fmt] = LLMEngine(config, loaded=load_model(path, device="cpu", **formats))
    vocab = next(iter(engines.values())).model.config.vocab_size
    steps: dict[str, list[float]] = {fmt: [] for fmt in engines}
    for r in range(args.rounds + 1):  # round 0 untimed: compiles, buffers
        prompts = _prompts(args.sequences, args.prompt_len, vocab, seed=r)
        for fmt, engine in engines.items():
            seconds, _ = decode_step_seconds(engine, prompts, args.max_tokens, f"r{r}")
            steps[fmt] += seconds if r else []
    result = {
        "environment": environment.cpu(),
        "model": path,
        "lm_head_format": args.lm_head_format,
        "kv_cache_dtype": args.kv_cache_dtype,
        "compile_cpu_decode": args.compile_cpu_decode,
        "sequences": args.sequences,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "median_decode_step_ms": {fmt: 1e3 * statistics.median(s) for fmt, s in steps.items()},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
