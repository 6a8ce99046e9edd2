"""Kiln's two CPU W8A8 kernels side by side on SmolLM2-135M's decoder GEMMs, cache-cold.

30 layers x (fused QKV 576->960, o_proj 576->576, fused gate/up 576->3072, down 1536->576) with distinct
random weights (~106 MB of int8, more than the caches hold), called in model order, plus the 49152 x 576
LM head; median wall ms over repeats for each row count, on the AMX tile kernel (where this CPU has
AMX int8) and on oneDNN's int8 GEMM (KILN_CPU_AMX=0 at pack time), in the same process. Prints one
JSON object with the CPU model and ISA flags (kiln.environment.cpu).

    OMP_NUM_THREADS=2 python scripts/cpu_w8a8_kernels.py [--rows 1,16,270]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kiln import environment
from kiln.loaders.cpu_format_probe import time_call
from kiln.ops.gemm import cpu_w8a8
from kiln.ops.gemm.shapes import SMOLLM2_135M

LAYERS = 30
SHAPES = SMOLLM2_135M  # (K, N) per decoder layer
HEAD = (576, 49152)


def _pack(matrix: torch.Tensor, kernel: str) -> tuple[torch.Tensor, ...]:
    os.environ["KILN_CPU_AMX"] = "1" if kernel == "amx" else "0"
    try:
        return cpu_w8a8.pack(matrix)
    finally:
        os.environ.pop("KILN_CPU_AMX")


def _calls(weights: list, x: dict):
    """One pass of w8a8_linear over `weights` (pack() tuples), each on the x of its in-features."""

    def run():
        for rows in weights:
            cpu_w8a8.w8a8_linear(x[rows[3].shape[0]], *rows, None, torch.float32)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,270", help="comma-separated row counts (M)")
    args = parser.parse_args()
    if not cpu_w8a8.load():
        raise SystemExit("the native W8A8 op is not available here (KILN_CPU_NATIVE, compiler, ninja)")
    g = torch.Generator().manual_seed(0)
    matrices = [torch.randn(n, k, generator=g) for _ in range(LAYERS) for k, n in SHAPES]
    head = torch.randn(HEAD[1], HEAD[0], generator=g)
    result = {"cpu": environment.cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    for kernel in cpu_w8a8.kernels():
        layers = [_pack(m, kernel) for m in matrices]
        head_rows = _pack(head, kernel)
        for m in (int(r) for r in args.rows.split(",")):
            x = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
            repeats = 15 if m <= 64 else 5
            result[f"{kernel}_rows{m}"] = {
                "decoder_120_gemms_ms": round(1e3 * time_call(_calls(layers, x), repeats), 3),
                "lm_head_ms": round(1e3 * time_call(_calls([head_rows], x), repeats), 3),
            }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
