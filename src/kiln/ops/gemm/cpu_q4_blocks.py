"""GGUF Q4_0 / Q4_1 / Q4_K weights kept as 4-bit blocks on the CPU, for the "q4_blocks_onednn" layout
(kiln.ops.gemm.weight_formats): `pack` splits a weight into its nibbles and its d and m per 32 weights
(w = d * q + m exactly), `q4_blocks_gemv` computes one row of y = x @ W^T in float32 on those values
(no rounding of the weights or of x), `q4_blocks_gemm` a few rows (batched decode), `block_values`
reads the nibbles back.

torch.ops.kiln_cpu.q4_blocks_gemv and q4_blocks_gemm (cpu_q4_blocks.cpp, part of Kiln's native CPU library,
kiln.ops.native_cpu) reads half a byte a weight; where the library cannot be built the same sum runs
as tensor code (correct, several times slower). Each op has a fake implementation, registered by
`load()`, which `pack` calls: the engine's compiled decode step traces the op as one node only if it
was loaded before the trace.
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.quant.gguf_blocks import BLOCK_WEIGHTS

BLOCK = BLOCK_WEIGHTS["Q4_0"]  # weights per GGUF Q4 block (and per Q4_K sub-block)
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the op's fake, once per process. True when the
    native kernel runs here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fake)


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::q4_blocks_gemv")
    def _(x, nibbles, scales, mins):
        return x.new_empty((1, nibbles.shape[0]))

    @torch.library.register_fake("kiln_cpu::q4_blocks_gemm")
    def _(x, nibbles, scales, mins):
        return x.new_empty((x.shape[0], nibbles.shape[0]))


def pack(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_0 / Q4_1 / Q4_K GGUFWeight [N, K] -> (nibbles uint8 [N, K / 2], each block's 16 bytes
    with weight j in byte j's low nibble and weight j + 16 in its high one; scales, mins float32
    [N, K / 32]). Loads the native kernel (`load`) first."""
    load()
    n, k = weight.shape
    q = weight.nibbles().to(torch.uint8).view(n, k // BLOCK, BLOCK)
    nibbles = (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).reshape(n, k // 2).contiguous()
    scales, mins = (t.contiguous() for t in weight.scales_and_mins())
    return nibbles, scales, mins


def block_values(nibbles: torch.Tensor, groups: int) -> torch.Tensor:
    """nibbles uint8 [N, groups * 16] (as `pack` returns them) -> the 4-bit values uint8 [N, groups, 32]
    in weight order."""
    blocks = nibbles.view(nibbles.shape[0], groups, BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1)


def q4_blocks_gemv(
    x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """x [1, K] float (read as float32), nibbles uint8 [N, K / 2] (`pack`), scales and mins float32
    [N, K / 32] -> y float32 [1, N], y[n] = sum_k x[k] * (scales[n, k // 32] * q[n, k] + mins[n, k // 32])."""
    return _native_or_tensor("q4_blocks_gemv", x, nibbles, scales, mins)


def q4_blocks_gemm(
    x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """x [M, K] float (read as float32) -> y float32 [M, N], each row as `q4_blocks_gemv` computes it:
    for a few rows (batched decode), which read the blocks once instead of the float32 copy."""
    return _native_or_tensor("q4_blocks_gemm", x, nibbles, scales, mins)


def _native_or_tensor(op: str, x, nibbles, scales, mins) -> torch.Tensor:
    """torch.ops.kiln_cpu.<op> on float32 x where the library loads, else the same sum as tensor code."""
    x = x.float()
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return getattr(torch.ops.kiln_cpu, op)(x, nibbles, scales, mins)
    return _tensor_gemv(x, nibbles, scales, mins)


def _tensor_gemv(
    x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """The tensor form of both kernels: x [M, K] -> [M, N]."""
    n, groups = scales.shape
    q = block_values(nibbles, groups).float()  # [N, groups, 32]
    xs = x.reshape(x.shape[0], 1, groups, BLOCK)
    return ((q * xs).sum(-1) * scales + xs.sum(-1) * mins).sum(-1)
