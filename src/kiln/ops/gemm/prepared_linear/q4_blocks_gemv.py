"""The one-row kernel of the "q4_blocks_onednn" layout: y = x @ W^T with W kept as GGUF Q4_0 / Q4_1
blocks, w = d * q + m, computed in float32 on those exact values (no rounding of the weights or of x).

torch.ops.kiln_cpu.q4_blocks_gemv (gemm/cpu_q4_blocks.cpp, part of Kiln's native CPU library,
kiln.ops.native_cpu) reads half a byte a weight; where the library cannot be built the same sum runs
as tensor code (correct, several times slower). The op has a fake implementation, so the engine's
compiled decode step holds it as one node.
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu

BLOCK = 32  # weights per GGUF Q4 block
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the op's fake, once per process. True when the
    native kernel runs here. Call it eagerly (not while torch.compile traces)."""
    if _state["loaded"] is None:
        _state["loaded"] = native_cpu.load()
        if _state["loaded"]:

            @torch.library.register_fake("kiln_cpu::q4_blocks_gemv")
            def _(x, nibbles, scales, mins):
                return x.new_empty((1, nibbles.shape[0]))

    return _state["loaded"]


def _tensor_gemv(
    x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    n, groups = scales.shape
    blocks = nibbles.view(n, groups, BLOCK // 2)
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()  # [N, G, 32] in weight order
    xs = x.view(1, groups, BLOCK)
    return ((q * xs).sum(-1) * scales + xs.sum(-1) * mins).sum(-1).view(1, n)


def q4_blocks_gemv(
    x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """x [1, K] float (read as float32), nibbles uint8 [N, K / 2] (each 32-weight block's 16 bytes as in
    the GGUF file: byte j holds weight j low, j + 16 high), scales and mins float32 [N, K / 32] ->
    y float32 [1, N], y[n] = sum_k x[k] * (scales[n, k // 32] * q[n, k] + mins[n, k // 32])."""
    x = x.float()
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return torch.ops.kiln_cpu.q4_blocks_gemv(x, nibbles, scales, mins)
    return _tensor_gemv(x, nibbles, scales, mins)
