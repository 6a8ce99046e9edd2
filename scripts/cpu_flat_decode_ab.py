"""Eager single-stream decode on the embedded model: the module path against the flat one-token loop
(kiln.models.cpu_flat_decode), in one process, alternating, so the host's drift cancels.

One engine; before each run its model's flat_decode is set (the loop the runner built) or cleared
(the modules). Each run generates --max-tokens greedy tokens of one chat prompt; prints the median
time per output token after the first of each path over --rounds runs, and whether both paths gave
the same tokens.

    OMP_NUM_THREADS=2 python scripts/cpu_flat_decode_ab.py [--rounds 8] [--max-tokens 128]
        [--cpu-format q4_blocks_a8 --lm-head-format q8_blocks_a8]
"""

from __future__ import annotations

import argparse
import statistics

from kiln.engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cpu-format")
    parser.add_argument("--lm-head-format")
    args = parser.parse_args()
    llm = LLM(device="cpu", cpu_format=args.cpu_format, lm_head_format=args.lm_head_format)
    model = llm.engine.runner.model
    flat = model.flat_decode
    if flat is None:
        raise SystemExit("the flat loop does not apply here (configuration, or KILN_CPU_FLAT_DECODE=0)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    per_token: dict[str, list[float]] = {"modules": [], "flat": []}
    tokens = {}
    for _ in range(args.rounds):
        for name in per_token:
            model.flat_decode = flat if name == "flat" else None
            out = llm.chat(messages, params)[0]
            tokens[name] = out.token_ids
            per_token[name].append((out.finished_time - out.first_token_time) / (len(out.token_ids) - 1))
    model.flat_decode = flat
    for name, times in per_token.items():
        ms = statistics.median(times) * 1e3
        print(f"{name:8s} {ms:6.2f} ms a token ({1e3 / ms:.1f} tok/s), median of {len(times)}")
    print("same tokens:", tokens["modules"] == tokens["flat"])


if __name__ == "__main__":
    main()
