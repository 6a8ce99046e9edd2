"""How the engine's decode step time grows with the context, on the embedded model.

`kiln profile --engine` times a few steps at one context; this runs `--batch` identical requests
for `--steps` decode steps after prefill (and two untimed steps, which compile the batch size with
`--compile-cpu-decode`) and prints the median step time of each window of 10 steps, so a cost that
grows with the context (paged attention) shows as a slope.

    OMP_NUM_THREADS=2 python scripts/decode_step_times.py --batch 16 --compile-cpu-decode \
        --cpu-format int4_bf16 --lm-head-format int4_bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPT = "Write a short story about a robot who learns to paint, in the style of a fairy tale for children."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=190)
    parser.add_argument("--window", type=int, default=10, help="steps per printed median")
    parser.add_argument("--prompt-repeats", type=int, default=1, help="the prompt this many times over")
    parser.add_argument("--compile-cpu-decode", action="store_true")
    parser.add_argument("--cpu-format", default=None)
    parser.add_argument("--lm-head-format", default=None)
    args = parser.parse_args()

    from kiln.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            device="cpu",
            max_num_seqs=args.batch,
            compile_cpu_decode=args.compile_cpu_decode,
            cpu_format=args.cpu_format,
            lm_head_format=args.lm_head_format,
        )
    )
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    prompt = " ".join([PROMPT] * args.prompt_repeats)
    for i in range(args.batch):
        engine.add_request(f"r{i}", prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or not all(seq.num_output_tokens for seq in scheduler.running):  # prefill
        engine.step()
    engine.step()  # first decode steps: the compiled step compiles here
    engine.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    prompt_len = len(engine.tokenizer.encode(prompt))
    for start in range(0, args.steps - args.window + 1, args.window):
        window = times[start : start + args.window]
        print(
            f"batch {args.batch}, context ~{prompt_len + 3 + start}: "
            f"{statistics.median(window) * 1e3:.2f} ms / step (median of {len(window)})"
        )
    compiled = engine.runner.compiled_decode
    if compiled is not None:
        sizes = sorted(compiled.compiled_sizes)
        print(f"compiled batch sizes {sizes}, fell back to eager: {compiled.failed}")


if __name__ == "__main__":
    main()
