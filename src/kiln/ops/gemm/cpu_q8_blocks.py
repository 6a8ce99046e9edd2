"""GGUF Q8_0 weights kept as their int8 values and per-32 scales on the CPU, for the "q8_blocks_onednn"
and "int8_blocks_onednn" layouts (kiln.ops.gemm.weight_formats): `pack` splits a weight into them
(w = d * q exactly), `q8_blocks_gemv` computes one row of y = x @ W^T in float32 on those values,
`q8_blocks_gemm` a few rows (batched decode).

torch.ops.kiln_cpu.q8_blocks_gemv (cpu_q8_blocks.cpp, part of Kiln's native CPU library,
kiln.ops.native_cpu) reads a byte a weight; where the library cannot be built the same sum runs as a
GEMV inductor compiles (kiln.ops.gemm.prepared_linear.int8_blocks_gemv). As for the Q4 kernel
(kiln.ops.gemm.cpu_q4_blocks), `pack` loads the op and registers its fake, so a compiled decode step
traced later holds it as one node.
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

BLOCK = BLOCK_WEIGHTS["Q8_0"]  # weights per scale: one Q8_0 block
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the op's fake, once per process. True when the
    native kernel runs here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fake)


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::q8_blocks_gemv")
    def _(x, values, scales):
        return x.new_empty((1, values.shape[0]))

    @torch.library.register_fake("kiln_cpu::q8_blocks_gemm")
    def _(x, values, scales):
        return x.new_empty((x.shape[0], values.shape[0]))


def loaded() -> bool:
    """Whether `load` ran and the native kernel is there (no build or load attempted: safe while
    torch.compile traces)."""
    return bool(_state["loaded"])


def pack(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 GGUFWeight [N, K] -> (values int8 [N, K], scales float32 [N, K / 32]), w = d * q
    exactly (d is fp16 in the file). Loads the native kernel (`load`) first."""
    load()
    n, k = weight.shape
    blocks = weight.data.view(n, k // BLOCK, BLOCK_BYTES["Q8_0"])
    scales = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32).view(n, -1)
    values = blocks[..., 2:].contiguous().view(torch.int8).view(n, k)
    return values, scales


def q8_blocks_gemv(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [1, K] float32, values int8 [N, K], scales float32 [N, K / 32] -> y float32 [1, N],
    y[n] = sum_k x[k] * scales[n, k // 32] * values[n, k], through the native kernel (`load` must
    have returned True)."""
    return torch.ops.kiln_cpu.q8_blocks_gemv(x, values, scales)


def q8_blocks_gemm(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] float (read as float32) -> y float32 [M, N], each row as `q8_blocks_gemv` computes it;
    where the native library is not loaded, the same sum as tensor code."""
    x = x.float()
    if loaded():
        return torch.ops.kiln_cpu.q8_blocks_gemm(x, values, scales)
    n, k = values.shape
    blocks = values.view(n, k // BLOCK, BLOCK).float() * scales.view(n, -1, 1)
    return x @ blocks.view(n, k).T
