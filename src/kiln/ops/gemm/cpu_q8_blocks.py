"""GGUF Q8_0 weights kept as their int8 values and per-32 scales on the CPU, for the "q8_blocks_onednn"
and "int8_blocks_onednn" layouts (kiln.ops.gemm.weight_formats): `pack` splits a weight into them
(w = d * q exactly), `q8_blocks_gemv` computes one row of y = x @ W^T in float32 on those values,
`q8_blocks_gemm` a few rows (batched decode). GGUF Q5_0 weights take the same form (values q - 16,
w = d * (q - 16)), and Q6_K weights with a scale per 16 ("q8_blocks_onednn" only): values q - 32 and
scales d * sc, exact in float32 (ggml's own product). GGUF Q5_K weights (w = (d * sc) * q - dmin * m,
q in 0..31) keep q with d * sc and a min -(dmin * m) per 32 ("q8_blocks_mins_onednn": `pack_with_mins`):
the same kernels given the mins (`mins=`), which add each block's sum of x times its min (one row) or
decode each block as fma(q, d * sc, min), the float32 copy's values (several rows). A fused projection
whose parts mix GGUF types (kiln.quant.gguf_blocks.GGUFStackedWeight: Q4_K beside Q6_K) takes the
same layout with a scale and a min per 16.

torch.ops.kiln_cpu.q8_blocks_gemv (cpu_q8_blocks.cpp, part of Kiln's native CPU library,
kiln.ops.native_cpu) reads a byte a weight; where the library cannot be built the same sum runs as a
GEMV inductor compiles (kiln.ops.gemm.prepared_linear.int8_blocks_gemv). As for the Q4 kernel
(kiln.ops.gemm.cpu_q4_blocks), `pack` loads the op and registers its fake, so a compiled decode step
traced later holds it as one node.
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, QUANT_OFFSET, block_fields

BLOCK = BLOCK_WEIGHTS["Q8_0"]  # weights per scale: one Q8_0 block
QTYPES = ("Q8_0", "Q5_0", "Q6_K")  # what `pack` takes: scales per 32 weights, per 16 for Q6_K
MIN_QTYPES = ("Q5_K",)  # what `pack_with_mins` takes
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the op's fake, once per process. True when the
    native kernel runs here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fake)


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::q8_blocks_gemv")
    def _(x, values, scales, mins=None):
        return x.new_empty((1, values.shape[0]))

    @torch.library.register_fake("kiln_cpu::q8_blocks_gemm")
    def _(x, values, scales, mins=None):
        return x.new_empty((x.shape[0], values.shape[0]))


def loaded() -> bool:
    """Whether `load` ran and the native kernel is there (no build or load attempted: safe while
    torch.compile traces)."""
    return bool(_state["loaded"])


def pack(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0, Q5_0 or Q6_K GGUFWeight [N, K] -> (values int8 [N, K], scales float32 [N, K / B]),
    B = 32 (Q8_0: w = d * q, d fp16 in the file; Q5_0: w = d * (q - 16), values q - 16) or 16 (Q6_K:
    w = (d * sc) * (q - 32), values q - 32), exact. Loads the native kernel (`load`) first."""
    load()
    n, k = weight.shape
    if weight.qtype in ("Q5_0", "Q6_K"):
        q, scales, _ = block_fields(weight.data.view(n, -1), weight.qtype)
        return (q - QUANT_OFFSET[weight.qtype]).to(torch.int8), scales
    if weight.qtype != "Q8_0":
        raise ValueError(f"cpu_q8_blocks.pack: GGUF {weight.qtype} unsupported, expected one of {QTYPES}")
    blocks = weight.data.view(n, k // BLOCK, BLOCK_BYTES["Q8_0"])
    scales = blocks[..., :2].contiguous().view(torch.float16).to(torch.float32).view(n, -1)
    values = blocks[..., 2:].contiguous().view(torch.int8).view(n, k)
    return values, scales


def pack_with_mins(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q5_K GGUFWeight [N, K] -> (values int8 [N, K]: q in 0..31, scales float32 [N, K / 32]:
    d * sc, mins float32 [N, K / 32]: -(dmin * m)), w = values * scales + mins exactly (ggml's
    products, exact in float32). Loads the native kernel (`load`) first."""
    if weight.qtype not in MIN_QTYPES:
        raise ValueError(f"cpu_q8_blocks.pack_with_mins: GGUF {weight.qtype} unsupported, expected Q5_K")
    load()
    n = weight.shape[0]
    q, scales, mins = block_fields(weight.data.view(n, -1), weight.qtype)
    return q.to(torch.int8), scales, mins


def q8_blocks_gemv(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """x [1, K] float32, values int8 [N, K], scales float32 [N, K / B] (B = 32 or 16) -> y float32 [1, N],
    y[n] = sum_k x[k] * (scales[n, k // B] * values[n, k] + mins[n, k // B]) (no mins term without
    `mins`: float32, the scales' shape), through the native kernel (`load` must have returned True)."""
    return torch.ops.kiln_cpu.q8_blocks_gemv(x, values, scales, mins)


def q8_blocks_gemm(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float (read as float32) -> y float32 [M, N], each row as `q8_blocks_gemv` computes it
    (with `mins` where given); where the native library is not loaded, the same sum as tensor code on
    the float32 matrix."""
    x = x.float()
    if loaded():
        return torch.ops.kiln_cpu.q8_blocks_gemm(x, values, scales, mins)
    n, k = values.shape
    blocks = values.view(n, scales.shape[1], -1).float() * scales.view(n, -1, 1)
    if mins is not None:
        blocks = blocks + mins.view(n, -1, 1)  # d * q is exact: one rounding, the float32 copy's
    return x @ blocks.view(n, k).T
