"""Batched-decode linears of SmolLM2-135M on the CPU: the GGUF-block formats against fp32, M rows at a
time, cache-cold.

30 layers x (fused QKV 576->960, o_proj 576->576, fused gate/up 576->3072, down 1536->576) as distinct
random GGUF Q4_1 matrices, and the LM head (49152 x 576) as GGUF Q8_0, each prepared as "q4_blocks" /
"q8_blocks" and as "fp32" (kiln.ops.gemm.weight_formats) and called through kiln.ops.prepared_linear
with M rows: up to native_cpu.blocks_gemm_rows() rows the blocks formats run their multi-row
kernels (q4_blocks_gemm, q8_blocks_gemm) and for native_cpu.blocks_tiles_rows(kind) rows (AVX-512 builds)
their tile kernels (q4_tiles_gemm, q8_tiles_gemm), beyond them their float32 copies, as "fp32" does.
The row kernels are also timed on their own at every M ("... row kernel"), against the tiles.
Before every pass 256 MB are written, so the weights come from memory. Median wall ms over the passes,
formats interleaved (each pass starting at the next); prints one JSON object with the CPU model and ISA
flags (kiln.environment.cpu).

    OMP_NUM_THREADS=2 python scripts/cpu_blocks_rows.py [--rows 2,4,8,16,32,48,64] [--passes 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kiln.ops
from kiln import environment
from kiln.ops import native_cpu
from kiln.ops.gemm.cpu_q4_blocks import q4_blocks_gemm
from kiln.ops.gemm.cpu_q8_blocks import q8_blocks_gemm
from kiln.ops.gemm.shapes import SMOLLM2_135M
from kiln.ops.gemm.weight_formats import prepare_linear_weight
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight

LAYERS = 30
HEAD = (576, 49152)  # (K, N) of the tied LM head


def _prepared(weights, cpu_format):
    cpu = torch.device("cpu")
    return [prepare_linear_weight(w, device=cpu, dtype=torch.float32, cpu_format=cpu_format) for w in weights]


def _time(prepared, x, evict, row_kernel: bool) -> float:
    evict.fill_(1.0)
    start = time.perf_counter()
    for p in prepared:
        if row_kernel:  # the blocks' tensors before the float32 copy
            blocks = p.tensors[:2] if p.kind == "q8_blocks" else p.tensors[:3]
            gemm = q8_blocks_gemm if p.kind == "q8_blocks" else q4_blocks_gemm
            gemm(x[p.shape[1]], *blocks)
        else:
            kiln.ops.prepared_linear(x[p.shape[1]], p.layout, p.tensors, None, None)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,4,8,16,32,48,64", help="comma-separated row counts M")
    parser.add_argument("--passes", type=int, default=5, help="timed passes per format and M")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)

    def blocks(qtype, k, n):
        weight = torch.randn(n, k, generator=generator) * k**-0.5
        return GGUFWeight(qtype, quantize_blocks(weight, qtype), (n, k))

    layers = [blocks("Q4_1", k, n) for _ in range(LAYERS) for k, n in SMOLLM2_135M]
    head = [blocks("Q8_0", *HEAD)]
    sets = {
        "layers q4_blocks": _prepared(layers, "q4_blocks"),
        "layers fp32": _prepared(layers, "fp32"),
        "head q8_blocks": _prepared(head, "q8_blocks"),
        "head fp32": _prepared(head, "fp32"),
    }
    sets["layers q4_blocks row kernel"] = sets["layers q4_blocks"]
    sets["head q8_blocks row kernel"] = sets["head q8_blocks"]
    evict = torch.empty(64 * 1024 * 1024)  # 256 MB written before each pass
    ms: dict[str, dict[int, float]] = {name: {} for name in sets}
    with torch.inference_mode(), kiln.ops.trusted_inputs():
        for m in (int(r) for r in args.rows.split(",")):
            x = {k: torch.randn(m, k, generator=generator) for k in {576, 1536}}
            times: dict[str, list[float]] = {name: [] for name in sets}
            names = list(sets)
            for i in range(args.passes + 1):  # the first pass of each set warms its code, untimed
                # each pass starts at another set: a set's time depended on which one ran before it
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    prepared = sets[name]
                    times[name].append(_time(prepared, x, evict, name.endswith("row kernel")))
            for name, t in times.items():
                ms[name][m] = round(statistics.median(t[1:]) * 1e3, 3)
    result = {
        "what": "SmolLM2-135M decoder linears (120 GGUF Q4_1 matrices) and LM head (Q8_0), M rows, "
        "cache-cold, median ms",
        "environment": environment.cpu(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "blocks_gemm_rows": native_cpu.blocks_gemm_rows(),
        "blocks_tiles_rows": {kind: list(native_cpu.blocks_tiles_rows(kind)) for kind in ("q4", "q8")},
        "layouts": {name: prepared[0].layout for name, prepared in sets.items()},
        "ms": ms,
        "fp32_over_blocks": {
            part: {m: round(ms[f"{part} fp32"][m] / ms[f"{part} {fmt}"][m], 2) for m in ms[f"{part} fp32"]}
            for part, fmt in (("layers", "q4_blocks"), ("head", "q8_blocks"))
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
