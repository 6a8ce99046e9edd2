"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) as their files store them times x in exact float32: the
weights are ggml's decode (gguf.quants), each rounded once to float32 as a float32 copy of the matrix
would hold it, and x is not rounded. The tensors are `cpu_kquants_a8.pack`'s (the file's blocks and a
parts table), so one weight serves both these kernels and the a8 ones, at the file's 0.56 / 0.69 /
0.82 bytes a weight: the exact blocks layouts of kiln.ops.gemm.weight_formats hold 0.75 / 1.25 / 1.25
bytes of re-packed blocks (plus tiles) for the same matrices.

Two native kernels (part of Kiln's native CPU library, kiln.ops.native_cpu):
  - `kquants_gemm` (cpu_kquants.cpp), for a few rows. One row: Q4_K / Q5_K factored per sub-block of 32
    as the q4_blocks kernel is (d sc_j sum q x - dmin m_j sum x), Q6_K one exact product per weight.
    Two or more: up to 5 x rows a pass (AVX-512; 4 on AVX2) against several weight rows, each weight
    vector exact, one FMA chain per (x row, weight row) pair, so that from 2 rows on a row's outputs are
    bit for bit the same whatever rows share its call (batch invariant; one row sums in another order).
  - `kquants_panel_gemm` (cpu_blocks_panel.cpp), for more: each weight decoded once a call into the
    panel kernel's 14-row panels, each output one float32 sum over k in order (batch invariant).
`kquants_matmul` picks: up to ROWS_KERNEL_MAX rows the first, more the second.

The CPU format "kquants" (opt-in: kiln.ops.gemm.weight_formats) gives K-quant weights the "kquants"
layout on these tensors; the default exact formats keep their re-packed layouts, which are faster at
8-12 rows (their tile kernels) and at one row on warm matrices (README, "Exact kernels on a K-quant
file's own blocks").
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_kquants_a8

SUPER = cpu_kquants_a8.SUPER
# Up to this many rows `kquants_matmul` runs the row kernel, more the panel kernel: 2-core Zen 4 (AVX-512),
# four Llama-3.2-1B-shaped layers, cache-cold (scripts/cpu_kquants_rows.py), row / panel kernel 8.6 /
# 51.3 ms at 1 row, 17.5 / 52.1 at 4, 38.6 / 52.1 at 8, 46.0 / 52.0 at 10, 59.7 / 52.4 at 12.
ROWS_KERNEL_MAX = 10
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the ops' fakes, once per process. True when the
    native kernels run here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("kiln_cpu::kquants_gemm")
    def _(x, blocks, parts, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kiln_cpu::kquants_panel_gemm")
    def _(x, blocks, parts, n):
        return x.new_empty((x.shape[0], n))


def _check_x(op: str, x: torch.Tensor) -> None:
    if x.device.type != "cpu" or x.dim() != 2 or not x.is_floating_point() or x.shape[1] % SUPER:
        raise ValueError(
            f"{op}: x must be a floating-point CPU tensor [M, K] with K a multiple of {SUPER}, got "
            f"{x.dtype} {tuple(x.shape)} on {x.device}"
        )


def kquants_gemm(x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    """y float32 [M, n] = x @ W^T for x float [M, K] (read as float32) and W [n, K] the K-quant parts
    `cpu_kquants_a8.pack` gave (blocks uint8, parts int64 [P, 2]): the row kernel (module docstring).
    Row i of y equals kquants_gemm(x[i:i + 1], ...) bit for bit."""
    _check_x("kquants_gemm", x)
    return _run("kquants_gemm", x, blocks, parts, n)


def kquants_panel_gemm(x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    """The same product through the panel kernel (module docstring): each output one float32 sum over
    k in order, row i of y equal to its one-row call's bit for bit."""
    _check_x("kquants_panel_gemm", x)
    return _run("kquants_panel_gemm", x, blocks, parts, n)


def kquants_matmul(x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    """x @ W^T through the kernel for x's row count: kquants_gemm up to ROWS_KERNEL_MAX rows, else
    kquants_panel_gemm."""
    if x.shape[0] <= ROWS_KERNEL_MAX:
        return kquants_gemm(x, blocks, parts, n)
    return kquants_panel_gemm(x, blocks, parts, n)


def _run(op: str, x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    x = x.float()
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return getattr(torch.ops.kiln_cpu, op)(x, blocks, parts, n)
    w = cpu_kquants_a8.matrix(blocks, parts, x.shape[1])  # no library here: decode, then F.linear
    if w.shape[0] != n:
        raise ValueError(f"{op}: n = {n} but the parts hold {w.shape[0]} rows")
    return torch.nn.functional.linear(x, w)
