"""One-row decode GEMVs of SmolLM2-135M's decoder in each CPU weight format, cache-cold.

30 layers x (fused QKV 576->960, o_proj 576->576, fused gate/up 576->3072, down 1536->576) as distinct
random GGUF Q4_1 matrices, prepared in each format (kiln.ops.gemm.weight_formats) and called through
kiln.ops.prepared_linear in model order with one row; before every pass 256 MB are written, so the
weights come from memory as in a decode step. Median wall ms over the passes, formats interleaved;
prints one JSON object with the CPU model and ISA flags (kiln.environment.cpu).
`--q4-k-m`: instead 4 layers of Llama-3.2-1B's shapes (2048->3072, 2048->2048, 2048->16384,
8192->2048) typed as a Q4_K_M file types them: Q4_K, with down_proj Q6_K.

    OMP_NUM_THREADS=2 python scripts/cpu_one_row_formats.py [--formats fp16,fp32,q4_blocks,int4] [--passes 9]
        [--q4-k-m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kiln.ops
from kiln import environment
from kiln.ops.gemm.shapes import SMOLLM2_135M
from kiln.ops.gemm.weight_formats import prepare_linear_weight
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight

LAYERS = 30
SHAPES = SMOLLM2_135M  # (K, N) per decoder layer
LLAMA_1B = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]
Q4_K_M = ("Q4_K", "Q4_K", "Q4_K", "Q6_K")  # per projection, as llama.cpp's Q4_K_M (its down_proj: Q6_K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="fp16,fp32,q4_blocks,int4", help="comma-separated cpu formats")
    parser.add_argument("--passes", type=int, default=9, help="timed passes per format")
    parser.add_argument("--q4-k-m", action="store_true", help="Llama-3.2-1B shapes as Q4_K + Q6_K down")
    args = parser.parse_args()
    formats = args.formats.split(",")
    generator = torch.Generator().manual_seed(0)
    layers, shapes, qtypes = (4, LLAMA_1B, Q4_K_M) if args.q4_k_m else (LAYERS, SHAPES, ("Q4_1",) * 4)
    blocks = [
        GGUFWeight(q, quantize_blocks(torch.randn(n, k, generator=generator) * k**-0.5, q), (n, k))
        for _ in range(layers)
        for (k, n), q in zip(shapes, qtypes, strict=True)
    ]
    cpu = torch.device("cpu")
    prepared = {
        f: [prepare_linear_weight(w, device=cpu, dtype=torch.float32, cpu_format=f) for w in blocks]
        for f in formats
    }
    x = {k: torch.randn(1, k, generator=generator) for k, _ in shapes}
    evict = torch.empty(64 * 1024 * 1024)  # 256 MB written before each pass
    times: dict[str, list[float]] = {f: [] for f in formats}
    with torch.inference_mode(), kiln.ops.trusted_inputs():
        for _ in range(args.passes + 1):  # the first pass of each format warms its code, untimed
            for f in formats:
                evict.fill_(1.0)
                start = time.perf_counter()
                for p in prepared[f]:
                    kiln.ops.prepared_linear(x[p.shape[1]], p.layout, p.tensors, None, None)
                times[f].append(time.perf_counter() - start)
    result = {
        "what": (
            "Llama-3.2-1B-shaped GEMVs (4 layers, Q4_K, down_proj Q6_K), one row, cache-cold, median ms"
            if args.q4_k_m
            else "SmolLM2-135M decoder GEMVs (120 matrices, GGUF Q4_1), one row, cache-cold, median ms"
        ),
        "environment": environment.cpu(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "layouts": {f: sorted({p.layout for p in prepared[f]}) for f in formats},
        "ms": {f: round(statistics.median(t[1:]) * 1e3, 3) for f, t in times.items()},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
