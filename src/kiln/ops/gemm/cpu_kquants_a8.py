"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) as their files store them, times x quantized to Q8_K: the
kernels of the "kquants_a8" layout, which the a8 formats ("q4_blocks_a8", "q8_blocks_a8";
kiln.ops.gemm.weight_formats) give a K-quant weight, a plain one or a stacked projection whose parts
all are. llama.cpp's CPU arithmetic for these types.

Each row of x is quantized per 256 values (one K-quant super-block) to int8 with a float32 scale
(`quantize_q8_k`: d = max|x| / 127, q = round(x / d) half away from zero; ggml's Q8_K keeps the same
int8 values and scale), then each super-block's dot product is integer arithmetic
(cpu_kquants_a8.cpp), so y = W @ x' in float32 with x' = d * q. The weights are read at 0.56 (Q4_K),
0.69 (Q5_K) and 0.82 (Q6_K) bytes each, the files' own sizes, and the layout holds nothing else (the
Q8_0-x layouts of kiln.ops.gemm.cpu_blocks_a8 hold 0.75 / 1.25 / 1.25 bytes of blocks a weight, and a
float32 copy and tiles for several rows). `kquants_a8_gemv` takes one row; `kquants_a8_gemm` any
number, each row's outputs bit for bit those of `kquants_a8_gemv` on that row alone (batch invariant:
a sequence's tokens do not depend on the batch it decodes in), on CPUs with AMX-INT8 too, where from 12
rows of x it runs whole 16-row blocks of weights on int8 tiles (`KILN_CPU_AMX=0`: not).

A weight's `pack` form is two tensors: its parts' blocks, uint8 [sum of N_i * row_bytes_i] (the rows
of each part as in the file, parts in order), and `parts`, int64 [P, 2]: each part's GGML type id
(QTYPE_IDS) and row count. The ops are part of Kiln's native CPU library (kiln.ops.native_cpu); where
it cannot be built the same arithmetic runs as tensor code."""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_blocks_a8
from kiln.quant.gguf_blocks import (
    GGML_TYPE_IDS,
    K_QUANTS,
    GGUFStackedWeight,
    GGUFWeight,
    dequantize_blocks,
    row_bytes,
)

SUPER = 256  # values per Q8_K block of x, weights per K-quant super-block
QTYPE_IDS = {qtype: GGML_TYPE_IDS[qtype] for qtype in K_QUANTS}  # the types the kernels take
QTYPES_BY_ID = {v: k for k, v in QTYPE_IDS.items()}
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the ops' fakes, once per process. True when the
    native kernel runs here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("kiln_cpu::quantize_q8_k")
    def _(x):
        m, k = x.shape
        return (
            x.new_empty((m, k), dtype=torch.int8),
            x.new_empty((m, k // SUPER)),
            x.new_empty((m, k // 16), dtype=torch.int16),
        )

    @torch.library.register_fake("kiln_cpu::kquants_a8_gemv")
    def _(x, blocks, parts, n):
        return x.new_empty((1, n))

    @torch.library.register_fake("kiln_cpu::kquants_a8_gemm")
    def _(x, blocks, parts, n):
        return x.new_empty((x.shape[0], n))


def packable(weight) -> bool:
    """Whether `pack` takes `weight`: a GGUFWeight of QTYPE_IDS' types or a GGUFStackedWeight whose parts
    all are."""
    parts = weight.parts if isinstance(weight, GGUFStackedWeight) else (weight,)
    return all(isinstance(p, GGUFWeight) and p.qtype in QTYPE_IDS for p in parts)


def pack(weight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(blocks uint8 [bytes], parts int64 [P, 2]) for a weight `packable` takes (module docstring); None
    for any other weight."""
    if not packable(weight):
        return None
    parts = weight.parts if isinstance(weight, GGUFStackedWeight) else (weight,)
    # one part: its own bytes, no copy (a tied head shares them with the embedding's lookup table)
    blocks = parts[0].data.reshape(-1) if len(parts) == 1 else torch.cat([p.data.reshape(-1) for p in parts])
    table = torch.tensor([[QTYPE_IDS[p.qtype], p.shape[0]] for p in parts], dtype=torch.int64)
    return blocks.contiguous(), table


def super_bytes(parts: torch.Tensor) -> int:
    """The bytes `parts`' rows hold per 256 in-features (one super-block each); the types must be
    QTYPE_IDS'."""
    return sum(rows * row_bytes(QTYPES_BY_ID[qtype_id], SUPER) for qtype_id, rows in parts.tolist())


def in_features(blocks: torch.Tensor, parts: torch.Tensor) -> int:
    """K of the matrix `pack`'s two tensors hold: their bytes over the parts' bytes per 256 weights."""
    per_super = super_bytes(parts)
    return SUPER * blocks.numel() // per_super if per_super else 0


def matrix(blocks: torch.Tensor, parts: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """The float32 [N, K] matrix `pack`'s two tensors stand for: each part's gguf decode, in order (K:
    `in_features` unless given)."""
    k = in_features(blocks, parts) if k is None else k
    out, at = [], 0
    for qtype_id, rows in parts.tolist():
        qtype = QTYPES_BY_ID[qtype_id]
        size = rows * row_bytes(qtype, k)
        out.append(dequantize_blocks(blocks[at : at + size].view(rows, -1), qtype))
        at += size
    return torch.cat(out)


def _quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native quantizer as tensor code: cpu_blocks_a8's per 256 values, and q's sums per 16."""
    q, d = cpu_blocks_a8.quantize_tensor_form(x, SUPER)
    m, k = q.shape
    return q, d, q.view(m, k // 16, 16).sum(-1, dtype=torch.int32).to(torch.int16)


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float [M, K] (read as float32), K a multiple of 256 -> (q int8 [M, K], d float32 [M, K / 256],
    sums int16 [M, K / 16]): per 256 values d = max|x| / 127 and q = round(x / d), half away from
    zero; sums: q's sum over each 16. A block holding a NaN or an infinity gets d = NaN and q = 0."""
    cpu_blocks_a8.check_x("quantize_q8_k", x, None, SUPER)
    x = x.float().contiguous()
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return torch.ops.kiln_cpu.quantize_q8_k(x)
    return _quantize_tensor(x)


def q8_k_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 256) as the kernel sees it, float64: per 256 values the int8 values
    of gguf's own Q8_0 rounding (the `gguf` package's quantize_blocks, ggml's reference: d = max|x| /
    127, roundf(x / d)) applied to the whole block, times the float32 d; NaN for a block with a NaN or
    an infinity. The verifier's reference input for the a8 layouts' K-quant form, written without
    Kiln's quantizer where `gguf` is installed (the tensor form stands in elsewhere)."""
    return cpu_blocks_a8.int8_reference(x, SUPER)


def kquants_a8_gemv(x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    """y float32 [1, n] = x' @ W^T: x float32 [1, K] quantized to Q8_K (x'), W [n, K] the K-quant
    parts `pack` gave (blocks uint8, parts int64 [P, 2]; n the sum of their rows)."""
    cpu_blocks_a8.check_x("kquants_a8_gemv", x, 1, SUPER)
    return _run("kquants_a8_gemv", x, blocks, parts, n)


def kquants_a8_gemm(x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    """y float32 [M, n] = x' @ W^T for x float32 [M, K], each row quantized to Q8_K on its own: row i
    of y equals kquants_a8_gemv(x[i:i + 1], ...) bit for bit (the same operations in the same order,
    whatever M; the tensor form where the native library is missing is only close)."""
    cpu_blocks_a8.check_x("kquants_a8_gemm", x, None, SUPER)
    return _run("kquants_a8_gemm", x, blocks, parts, n)


def _run(op: str, x: torch.Tensor, blocks: torch.Tensor, parts: torch.Tensor, n: int) -> torch.Tensor:
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return getattr(torch.ops.kiln_cpu, op)(x.float(), blocks, parts, n)
    q, d, _ = _quantize_tensor(x.float().contiguous())
    xq = cpu_blocks_a8.dequantize_q8_0(q, d)
    w = matrix(blocks, parts, x.shape[1])
    if w.shape[0] != n:
        raise ValueError(f"{op}: n = {n} but the parts hold {w.shape[0]} rows")
    return xq @ w.T
