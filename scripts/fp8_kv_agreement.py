"""How far greedy decoding with an fp8 KV cache agrees with the model's own-dtype cache.

Runs the embedded SmolLM2-135M-Instruct on the CPU (float32 model, or --dtype bfloat16: the model
and its "auto" cache in bf16, as on a GPU) over a fixed prompt set, once with kv_cache_dtype="auto"
(the model dtype's cache), with "bfloat16" (float32 model only: a 16-bit cache under it) and with
"fp8": under both kv_cache_scales ("unit": 1.0; "calibrated": measured scales and centred keys)
without exact positions (kv_cache_exact_window=None), and as `--kv-cache-dtype fp8` runs by default
(calibrated, first block and last 32 positions exact: "fp8 exact32"). Prints per prompt the number of
leading output tokens that are equal to the "auto" run's (and for fp8, to the bf16 cache's: a float32
model's "bfloat16" run, a bfloat16 model's "auto" one), and, where they differ, the reference's
top-1 minus top-2 logprob at that position (a small gap is a near tie that any perturbation of the
attention can flip).

Prompt sets (--prompts): short (default), the 8 prompts below, plain and through the chat template
(3-10 and 33-40 tokens); long, the chat template over Kiln's perplexity text and one of 8 questions
about it (417-423 tokens, scripts/kv_cache_sensitivity.py's set: most of the cache is the prompt).

    OMP_NUM_THREADS=2 python scripts/fp8_kv_agreement.py --max-tokens 128 [--dtype bfloat16] [--prompts long]
"""

from __future__ import annotations

import argparse
import statistics

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Explain why the sky is blue.",
    "List three prime numbers:",
    "The quick brown fox",
    "In machine learning, a transformer is",
    "Water boils at",
]


# (name, kv_cache_dtype, kv_cache_scales, kv_cache_exact_window): the reference first
MODES = [
    ("auto", "auto", "calibrated", None),
    ("bfloat16", "bfloat16", "calibrated", None),
    ("fp8 unit", "fp8", "unit", None),
    ("fp8 calibrated", "fp8", "calibrated", None),
    ("fp8 exact32", "fp8", "calibrated", 32),
]


LONG_LABELS = [f"long prompt {i}" for i in range(8)]


def leading_equal(reference: list[int], other: list[int]) -> int:
    """How many tokens at the start of both lists are equal."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return min(len(reference), len(other))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompts", choices=["short", "long"], default="short")
    args = parser.parse_args()
    import torch

    from kiln.engine import LLM, SamplingParams
    from kiln.loaders import load_model

    dtype = getattr(torch, args.dtype)
    formats = {"cpu_format": "bf16", "lm_head_format": "bf16"} if dtype == torch.bfloat16 else {}
    loaded = load_model(device="cpu", dtype=dtype, **formats)
    if args.prompts == "long":
        from kv_cache_sensitivity import prompt_sets  # this folder is on sys.path

        sets = prompt_sets(loaded.tokenizer, "long")
        labels = {"long": list(LONG_LABELS)}
    else:
        chat = [loaded.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        plain = [loaded.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
        sets = {"plain": plain, "chat": chat}
        labels = {"plain": PROMPTS, "chat": PROMPTS}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    for name, prompts in sets.items():
        modes = [m for m in MODES if not (m[1] == "bfloat16" and dtype == torch.bfloat16)]
        runs = {}
        for mode, kv_cache_dtype, scales, exact_window in modes:
            llm = LLM(
                loaded=loaded,
                device="cpu",
                kv_cache_bytes=256 << 20,
                kv_cache_dtype=kv_cache_dtype,
                kv_cache_scales=scales,
                kv_cache_exact_window=exact_window,
            )
            runs[mode] = llm.generate(prompts, params)
        bf16 = "bfloat16" if "bfloat16" in runs else "auto"
        pairs = [("auto", mode) for mode, *_ in modes[1:]]
        pairs += [(bf16, mode) for mode, *_ in modes if mode.startswith("fp8") and bf16 != "auto"]
        for reference, mode in pairs:
            leads = []
            for text, ref, other in zip(labels[name], runs[reference], runs[mode], strict=True):
                lead = leading_equal(ref.token_ids, other.token_ids)
                leads.append(lead)
                gap = ""
                if lead < len(ref.token_ids):
                    top = sorted(ref.logprobs[lead].values(), reverse=True)
                    gap = f"  (reference top-1 - top-2 logprob there: {top[0] - top[1]:.3f})"
                print(
                    f"{name:5s} {mode:14s} vs {reference:8s} {lead:4d} / {len(ref.token_ids)}  {text!r}{gap}"
                )
            reached = sum(lead >= 16 for lead in leads)
            print(
                f"{name} {mode} vs {reference}: leading equal tokens {leads}; median "
                f"{statistics.median(leads)}; {reached}/{len(leads)} prompts agree on >= 16 tokens\n"
            )


if __name__ == "__main__":
    main()
