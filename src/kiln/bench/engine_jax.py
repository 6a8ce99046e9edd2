"""`kiln bench engine --jax`: the JAX Llama (kiln.jax.models) beside the PyTorch engine, same run.

For each concurrency c: c prompts (the same random-token prompts the engine's row for c got)
generate max_tokens tokens greedily as one batch through `kiln.jax.generate` (one batched prefill,
then decode steps of the whole batch), float32 weights, the device's default backend (xla on the
CPU). Each shape runs once untimed first, so jit compilation is not timed. TTFT is the time of a
max_tokens=1 call (prefill + first token); TPOT the rest divided by the remaining tokens.
"""

from __future__ import annotations

import sys
import time


def bench_jax(model_path: str, prompts: dict[int, list[list[int]]], max_tokens: int) -> list[dict]:
    """One row per concurrency c (prompts[c]: c token-id lists), as kiln.bench.engine.Result fields:
    system "kiln-jax", scenario "single-stream" for c = 1 else "concurrent"."""
    import jax

    from kiln.jax.models import Llama, generate
    from kiln.loaders import open_checkpoint

    model = Llama.from_checkpoint(open_checkpoint(model_path))
    print(f"kiln-jax on {jax.devices()[0].platform}, float32 weights", file=sys.stderr, flush=True)
    rows = []
    for c, batch in prompts.items():
        generate(model, batch, 1)  # compile this bucket's prefill
        generate(model, batch, max_tokens)  # and its decode step
        start = time.perf_counter()
        generate(model, batch, 1)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        tokens = sum(len(row) for row in generate(model, batch, max_tokens))
        seconds = time.perf_counter() - start
        rows.append(
            {
                "system": "kiln-jax",
                "scenario": "single-stream" if c == 1 else "concurrent",
                "concurrency": c,
                "output_tokens": tokens,
                "seconds": seconds,
                "tok_per_s": tokens / seconds,
                "ttft_ms": ttft * 1e3,
                "tpot_ms": (seconds - ttft) / max(1, max_tokens - 1) * 1e3,
            }
        )
    return rows
