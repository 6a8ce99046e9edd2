"""The native CPU paged decode kernel (torch.ops.kiln_cpu.paged_decode) as a decode step meets it:
one call per layer over `--layers` layers' own KV caches (together larger than the last-level cache,
so every call reads its keys and values from memory), `--sequences` sequences whose blocks interleave
as a lockstep batch's do, SmolLM2-135M's heads (9 query, 3 KV, head_dim 64). Contexts are drawn in
[ctx - 64, ctx]. Per cache dtype and context: the median milliseconds for all layers, the GB/s of
key and value bytes read, and that as a share of a streaming read of a 256 MB tensor timed in the
same run (torch's sum, 2 threads: what this host's memory gives one plain stream). Prints one JSON
object with the CPU model and ISA flags (kiln.environment.cpu).

    OMP_NUM_THREADS=2 python scripts/cpu_paged_decode_cold.py [--contexts 96,400] [--layers 30]
        [--sequences 16] [--dtypes float32,bfloat16,float16]
"""

from __future__ import annotations

import argparse
import json

import torch

from kiln import environment
from kiln.loaders.cpu_format_probe import time_call
from kiln.ops.attention.paged_decode_attention import cpu_native

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def stream_read_gbs(repeats: int = 10) -> float:
    """GB/s of torch.sum over a 256 MB float32 tensor (read once per call)."""
    x = torch.randn(64 * 1024 * 1024)
    return x.numel() * 4 / time_call(x.sum, repeats) / 1e9


def layers_case(ctx: int, dtype: torch.dtype, layers: int, sequences: int, repeats: int) -> dict:
    """One decode step's attention over `layers` layers at contexts in [ctx - 64, ctx]."""
    generator = torch.Generator().manual_seed(ctx)
    width = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    blocks = sequences * width
    # block j of sequence b at j * sequences + b: sequences that grow a block a step apart interleave
    rows = [[j * sequences + b for j in range(width)] for b in range(sequences)]
    tables = torch.tensor(rows, dtype=torch.int32)
    lens = torch.randint(max(1, ctx - 64), ctx + 1, (sequences,), generator=generator, dtype=torch.int32)
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [
        (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
        for _ in range(layers)
    ]
    queries = [torch.randn(sequences, HEADS, HEAD_DIM, generator=generator) for _ in range(layers)]

    def step():
        for (k, v), q in zip(caches, queries, strict=True):
            cpu_native.paged_decode(q, k, v, tables, lens, HEAD_DIM**-0.5, None)

    seconds = time_call(step, repeats)
    read = layers * 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * caches[0][0].element_size()
    return {"context": ctx, "dtype": str(dtype).removeprefix("torch."), "ms": 1e3 * seconds,
            "read_gbs": read / seconds / 1e9, "read_mb": read / 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="96,400")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not cpu_native.load():
        raise SystemExit("the native CPU library is not available here (kiln.ops.native_cpu)")
    stream = stream_read_gbs()
    cases = [
        layers_case(int(ctx), getattr(torch, dtype), args.layers, args.sequences, args.repeats)
        for ctx in args.contexts.split(",")
        for dtype in args.dtypes.split(",")
    ]
    for case in cases:
        case["share_of_stream_read"] = case["read_gbs"] / stream
    result = {
        "environment": environment.cpu(),
        "threads": torch.get_num_threads(),
        "layers": args.layers,
        "sequences": args.sequences,
        "stream_read_gbs": stream,
        "cases": cases,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
