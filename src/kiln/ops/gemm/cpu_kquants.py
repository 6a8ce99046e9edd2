"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) as their files store them times x in exact float32: the
weights are ggml's decode (gguf.quants), each rounded once to float32 as a float32 copy of the matrix
would hold it, and x is not rounded. The tensors are `cpu_kquants_a8.pack`'s (the file's blocks and a
parts table), so one weight serves both these kernels and the a8 ones, at the file's 0.56 / 0.69 /
0.82 bytes a weight: the exact blocks layouts of kiln.ops.gemm.weight_formats hold 0.75 / 1.25 / 1.25
bytes of re-packed blocks (plus tiles) for the same matrices.

Two native kernels (part of Kiln's native CPU library, kiln.ops.native_cpu):
  - `kquants_gemm` (cpu_kquants.cpp), for a few rows. One row: Q4_K / Q5_K factored per sub-block of 32
    as the q4_blocks kernel is (d sc_j sum q x - dmin m_j sum x), Q6_K one exact product per weight.
    Two or more: up to 4 x rows a pass against 4 weight rows (AVX-512; 2 on AVX2), each weight
    vector exact, one FMA chain per (x row, weight row) pair (AVX2 builds' Q4_K rows: factored as one
    row is, one weight row at a time); from TILE_MIN_ROWS rows on, AVX-512 builds
    run each group of 16 rows of one Q4_K, Q5_K or Q6_K part as a tile transposed on the fly from the
    file's bytes (cpu_k4_tiles.h, cpu_q6_k_tiles.h: a vector holds a weight of each of 16 rows, each x
    value broadcast), as the default layout's tiles do on a copy made at load. Within 2 ..
    TILE_MIN_ROWS - 1 rows and from TILE_MIN_ROWS on a row's outputs are bit for bit the same whatever
    rows share its call (batch invariant within each; one row sums in another order).
  - `kquants_panel_gemm` (cpu_blocks_panel.cpp), for more: each weight decoded once a call into the
    panel kernel's 14-row panels, each output one float32 sum over k in order (batch invariant).
`kquants_matmul` picks: up to rows_kernel_max() rows the first, more the second.

The CPU format "kquants" (kiln.ops.gemm.weight_formats) gives K-quant weights the "kquants" layout on
these tensors; the load-time probe times it against the re-packed exact layouts for K-quant models on
AVX-512 builds (kiln.loaders.cpu_format_probe.kquants_probed; README, "Exact kernels on a K-quant
file's own blocks").
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_kquants_a8

SUPER = cpu_kquants_a8.SUPER
# Up to rows_kernel_max() rows `kquants_matmul` runs the row kernel, more the panel kernel. Four
# Llama-3.2-1B-shaped layers cache-cold on a 2-core Zen 4 (scripts/cpu_kquants_rows.py), row / panel
# kernel: AVX-512 build (the row kernel's tiles) 49.3 / 53.3 ms at 16 rows, 73.0 / 88.3 at 24,
# 97.1 / 88.6 at 32 (Q5_K with a Q6_K down_proj: 50.6-51.3 / 54.8-55.1, 75.6-79.3 / 88.3-91.4,
# 97.5-100.2 / 88.0-92.4); AVX2 build 52.6 / 64.7 at 12, 63.7 / 64.7 at 14, 69.7 / 64.9 at 16.
ROWS_KERNEL_MAX = 12
ROWS_KERNEL_MAX_TILES = 24
# The row kernel's two ranges of batch invariance: from this many rows on AVX-512 builds run whole groups of
# 16 rows of a part as tiles (cpu_k4_tiles.h, cpu_q6_k_tiles.h; kTileMinRows in cpu_kquants.cpp), which
# sum in another order
TILE_MIN_ROWS = 5
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
    A row's outputs are bit for bit the same whatever rows share the call within 2 .. TILE_MIN_ROWS - 1
    rows and from TILE_MIN_ROWS on (one range from 2 without AVX-512)."""
    _check_x("kquants_gemm", x)
    return _run("kquants_gemm", x, blocks, parts, n)


def kquants_panel_gemm(x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    """The same product through the panel kernel (module docstring): each output one float32 sum over
    k in order, row i of y equal to its one-row call's bit for bit."""
    _check_x("kquants_panel_gemm", x)
    return _run("kquants_panel_gemm", x, blocks, parts, n)


def rows_kernel_max() -> int:
    """The most rows `kquants_matmul` gives the row kernel: ROWS_KERNEL_MAX_TILES where the library is
    built for AVX-512 (its tiles: native_cpu.blocks_tiles_rows's condition), else ROWS_KERNEL_MAX.
    A constant once the library is loaded."""
    return ROWS_KERNEL_MAX_TILES if native_cpu.blocks_tiles_rows("q4")[0] else ROWS_KERNEL_MAX


def kquants_matmul(x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    """x @ W^T through the kernel for x's row count: kquants_gemm up to rows_kernel_max() rows, else
    kquants_panel_gemm."""
    if x.shape[0] <= rows_kernel_max():
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
