"""Eager single-stream decode on the embedded model: the module path against the flat one-token loop
(kiln.models.cpu_flat_decode) in Python and, where the layouts allow, as one native call, in one
process, alternating, so the host's drift cancels.

One engine; before each run its model's flat_decode is set (the loop the runner built, with or
without its native call) or cleared (the modules). Each run generates --max-tokens greedy tokens of one
chat prompt; prints the median time per output token after the first of each path over --rounds runs,
and whether all paths gave the same tokens.

    OMP_NUM_THREADS=2 python scripts/cpu_flat_decode_ab.py [--rounds 8] [--max-tokens 128]
        [--cpu-format q4_blocks_a8 --lm-head-format q8_blocks_a8]
"""

from __future__ import annotations

import argparse
import copy
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
    paths = {"modules": None, "flat": flat}
    if flat.native is not None:  # the same loop in Python beside its native call
        paths = {"modules": None, "flat-python": copy.copy(flat), "flat-native": flat}
        paths["flat-python"].native = None
    per_token: dict[str, list[float]] = {name: [] for name in paths}
    tokens = {}
    for _ in range(args.rounds):
        for name, path in paths.items():
            model.flat_decode = path
            out = llm.chat(messages, params)[0]
            tokens[name] = out.token_ids
            per_token[name].append((out.finished_time - out.first_token_time) / (len(out.token_ids) - 1))
    model.flat_decode = flat
    for name, times in per_token.items():
        ms = statistics.median(times) * 1e3
        print(f"{name:12s} {ms:6.2f} ms a token ({1e3 / ms:.1f} tok/s), median of {len(times)}")
    print("same tokens:", all(t == tokens["modules"] for t in tokens.values()))


if __name__ == "__main__":
    main()
