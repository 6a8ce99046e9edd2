"""The exact K-quant kernels on the file's blocks (kiln.ops.gemm.cpu_kquants) against the layouts a
Q4_K_M file loads into today, at Llama-3.2-1B's shapes, cache-cold.

4 layers of (2048->3072, 2048->2048, 2048->16384, 8192->2048), Q4_K with down_proj Q6_K (as
scripts/cpu_one_row_formats.py --q4-k-m; --q5-k-m: Q5_K with down_proj Q6_K), as distinct random
matrices. For each row count: the default exact format ("q4_blocks": its layouts and prepared_linear's
routing), `kquants_gemm` (the row kernel), `kquants_panel_gemm` (the panel kernel) and the opt-in a8
layout ("kquants_a8", x rounded to 8 bits: not exact, for scale), in model order, 256 MB written before
every pass; median wall ms over the passes, the variants interleaved. Prints one JSON object with the
CPU model and ISA flags.

    OMP_NUM_THREADS=2 python scripts/cpu_kquants_rows.py [--rows 1,2,4,8,16,64] [--passes 7] [--q5-k-m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kiln.ops
from kiln import environment
from kiln.ops.gemm import cpu_kquants, cpu_kquants_a8
from kiln.ops.gemm.weight_formats import prepare_linear_weight
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight

LAYERS = 4
LLAMA_1B = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]  # (K, N) per layer
Q4_K_M = ("Q4_K", "Q4_K", "Q4_K", "Q6_K")
Q5_K_M = ("Q5_K", "Q5_K", "Q5_K", "Q6_K")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,64", help="comma-separated row counts")
    parser.add_argument("--passes", type=int, default=7, help="timed passes per variant and row count")
    parser.add_argument("--q5-k-m", action="store_true", help="Q5_K layers (down_proj Q6_K) instead of Q4_K")
    args = parser.parse_args()
    qtypes = Q5_K_M if args.q5_k_m else Q4_K_M
    cpu_kquants.load()
    generator = torch.Generator().manual_seed(0)
    weights = [
        GGUFWeight(q, quantize_blocks(torch.randn(n, k, generator=generator) * k**-0.5, q), (n, k))
        for _ in range(LAYERS)
        for (k, n), q in zip(LLAMA_1B, qtypes, strict=True)
    ]
    cpu = torch.device("cpu")
    exact, a8 = (
        [prepare_linear_weight(w, device=cpu, dtype=torch.float32, cpu_format=fmt) for w in weights]
        for fmt in ("q4_blocks", "q4_blocks_a8")
    )
    packed = [(w.shape[0], w.shape[1], *cpu_kquants_a8.pack(w)) for w in weights]

    def run_prepared(prepared, x):
        for p in prepared:
            kiln.ops.prepared_linear(x[p.shape[1]], p.layout, p.tensors, None, None)

    def run_op(op, x):
        for n, k, blocks, parts in packed:
            op(x[k], blocks, parts, n)

    variants = {
        "q4_blocks (exact default)": lambda x: run_prepared(exact, x),
        "kquants_gemm": lambda x: run_op(torch.ops.kiln_cpu.kquants_gemm, x),
        "kquants_panel_gemm": lambda x: run_op(torch.ops.kiln_cpu.kquants_panel_gemm, x),
        "kquants_a8 (not exact)": lambda x: run_prepared(a8, x),
    }
    evict = torch.empty(64 * 1024 * 1024)
    result_ms: dict[str, dict[str, float]] = {}
    with torch.inference_mode(), kiln.ops.trusted_inputs():
        for m in (int(r) for r in args.rows.split(",")):
            x = {k: torch.randn(m, k, generator=generator) for k, _ in LLAMA_1B}
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.passes + 1):  # the first pass warms the code, untimed
                for name, run in variants.items():
                    evict.fill_(1.0)
                    start = time.perf_counter()
                    run(x)
                    times[name].append(time.perf_counter() - start)
            result_ms[str(m)] = {name: round(statistics.median(t[1:]) * 1e3, 3) for name, t in times.items()}
    result = {
        "what": f"Llama-3.2-1B-shaped linears (4 layers, {qtypes[0]}, down_proj Q6_K), cache-cold, "
        "median ms by rows",
        "environment": environment.cpu(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "exact_layouts": sorted({p.layout for p in exact}),
        "a8_layouts": sorted({p.layout for p in a8}),
        "ms": result_ms,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
