"""One a8 K-quant kernel (kiln_cpu.kquants_a8_gemv / kquants_a8_gemm) on many distinct matrices, cache-cold.

40 copies of a 2048 x 2048 matrix of one K-quant type (4 random matrices, cloned: ~94 MB of Q4_K, more
than an L3), each multiplied by `rows` rows of x in turn; the median over the passes of the time per
matrix. Meant for A/B runs of a kernel change, one process per value, the two builds alternating
(PYTHONPATH=<a worktree>/src for the other): this host's timings move by 20-30 % between processes.

    OMP_NUM_THREADS=2 python scripts/cpu_kquants_a8_cold.py [--qtype Q4_K] [--rows 1] [--passes 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kiln import environment
from kiln.ops.gemm import cpu_kquants_a8
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qtype", default="Q4_K", choices=("Q4_K", "Q5_K", "Q6_K"))
    parser.add_argument("--rows", type=int, default=1, help="rows of x")
    parser.add_argument("--passes", type=int, default=15)
    args = parser.parse_args()
    if not cpu_kquants_a8.load():
        raise SystemExit("the native CPU library could not be built here")
    n = k = 2048
    generator = torch.Generator().manual_seed(0)
    floats = [torch.randn(n, k, generator=generator) * k**-0.5 for _ in range(4)]
    matrices = [GGUFWeight(args.qtype, quantize_blocks(w, args.qtype), (n, k)) for w in floats]
    packed = [tuple(t.clone() for t in cpu_kquants_a8.pack(matrices[i % 4])) for i in range(40)]
    x = torch.randn(args.rows, k, generator=generator)
    kernel = torch.ops.kiln_cpu.kquants_a8_gemv if args.rows == 1 else torch.ops.kiln_cpu.kquants_a8_gemm
    times = []
    for _ in range(args.passes):
        start = time.perf_counter()
        for tensors in packed:
            kernel(x, *tensors, n)
        times.append((time.perf_counter() - start) / len(packed))
    us = statistics.median(times) * 1e6
    print(json.dumps({
        "qtype": args.qtype, "rows": args.rows, "us_per_matrix": round(us, 1),
        "gb_per_s": round(packed[0][0].numel() / us / 1e3, 2), "threads": torch.get_num_threads(),
        "environment": environment.cpu(),
    }))


if __name__ == "__main__":
    main()
