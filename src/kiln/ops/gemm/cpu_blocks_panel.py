"""The many-row kernel of the exact GGUF-block layouts on the CPU ("q4_blocks[_a8]_onednn",
"q8_blocks[_a8]_onednn", "q8_blocks_mins[_a8]_onednn": kiln.ops.gemm.weight_formats): y = x @ W^T for
prefill and batches past the row and tile kernels, on the blocks those layouts already keep, so that
they need no float32 copy of the matrix (4 bytes a weight, most of a GGUF model's memory on the CPU
before). Each weight is rounded once to float32 (the copy's values: fma(q, d, m) / q * d), decoded once
per call into a panel of a few rows, and each output is one float32 sum over k in order, so a row's
outputs do not depend on the other rows of the call.

torch.ops.kiln_cpu.blocks_panel_gemm (cpu_blocks_panel.cpp, part of Kiln's native CPU library,
kiln.ops.native_cpu); native_cpu.blocks_panel_runs() says whether the layouts use it here (vector
builds). Without the library the same matrix runs through F.linear after decoding it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_q4_blocks

_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the op's fake, once per process. True when the
    native kernel runs here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fake)


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::blocks_panel_gemm")
    def _(x, values, scales, mins=None):
        return x.new_empty((x.shape[0], values.shape[0]))


def blocks_panel_gemm(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float (read as float32) -> y float32 [M, N] = x @ W^T, W the blocks' exact matrix:
    values uint8 [N, K / 2] (Q4 nibbles, cpu_q4_blocks.pack) with scales and mins float32 [N, K / 32]
    (w = d * q + m), or int8 [N, K] (cpu_q8_blocks.pack / pack_with_mins) with scales float32
    [N, K / 32] or [N, K / 16] and optional mins of the same shape (w = d * q (+ m))."""
    x = x.float()
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return torch.ops.kiln_cpu.blocks_panel_gemm(x, values, scales, mins)
    return F.linear(x, block_matrix(values, scales, mins))


def block_matrix(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The float32 [N, K] matrix the blocks stand for, each weight rounded once (as the kernel's)."""
    n, groups = scales.shape
    if values.dtype == torch.uint8:
        q = cpu_q4_blocks.block_values(values, groups).to(torch.float64)  # [N, groups, 32]
    else:
        q = values.to(torch.float64).view(n, groups, -1)
    w = q * scales.to(torch.float64)[..., None]
    if mins is not None:
        w = w + mins.to(torch.float64)[..., None]
    return w.view(n, -1).to(torch.float32)
