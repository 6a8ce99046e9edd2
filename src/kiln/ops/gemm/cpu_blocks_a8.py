"""GGUF Q4 / Q8 blocks times activations quantized to Q8_0, for the "q4_blocks_a8_onednn",
"q8_blocks_a8_onednn" and "q8_blocks_mins_a8_onednn" layouts (kiln.ops.gemm.weight_formats): llama.cpp's
CPU arithmetic.

The weights are the exact q4_blocks / q8_blocks tensors (kiln.ops.gemm.cpu_q4_blocks.pack,
cpu_q8_blocks.pack: Q8_0, Q5_0 and Q6_K, whose scales are per 16; Q5_K's values, scales and mins,
cpu_q8_blocks.pack_with_mins, or a stacked weight's fields, kiln.quant.gguf_blocks.GGUFStackedWeight).
At one row, x is first quantized per 32 values to int8 with a float32 scale (`quantize_q8_0`:
gguf's Q8_0 values; the scale is not rounded to float16), then each block's dot product is exact
integer arithmetic (AVX2's vpmaddubsw), so y = W @ x' in float32 with x' = d * q the quantized x. x's
rounding to 255 levels a block is the whole approximation; in exchange the kernels read the weights at
the memory bandwidth instead of converting each one to float32
(cpu_blocks_a8.cpp).

The ops are part of Kiln's native CPU library (kiln.ops.native_cpu); where it cannot be built the same
arithmetic runs as tensor code (quantize, then the exact float32 sum on x'). `load()` registers the
fakes, so a compiled decode step traced after it holds each op as one node.
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_q4_blocks, cpu_q8_blocks

BLOCK = 32  # values per Q8_0 activation block, weights per GGUF block
_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register the ops' fakes, once per process. True when the
    native kernels run here. Call it eagerly (not while torch.compile traces)."""
    return native_cpu.load_op(_state, _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("kiln_cpu::quantize_q8_0")
    def _(x):
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], x.shape[1] // BLOCK))

    @torch.library.register_fake("kiln_cpu::q4_blocks_a8_gemv")
    def _(x, nibbles, scales, mins):
        return x.new_empty((1, nibbles.shape[0]))

    @torch.library.register_fake("kiln_cpu::q8_blocks_a8_gemv")
    def _(x, values, scales):
        return x.new_empty((1, values.shape[0]))

    @torch.library.register_fake("kiln_cpu::q8_blocks_mins_a8_gemv")
    def _(x, values, scales, mins):
        return x.new_empty((1, values.shape[0]))


def pack_q4(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cpu_q4_blocks.pack(weight) (a GGUF Q4_0 / Q4_1 / Q4_K GGUFWeight), after `load`."""
    load()
    return cpu_q4_blocks.pack(weight)


def pack_q8(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """cpu_q8_blocks.pack(weight) (a GGUF Q8_0 / Q5_0 / Q6_K GGUFWeight), after `load`."""
    load()
    return cpu_q8_blocks.pack(weight)


def pack_q8_mins(weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cpu_q8_blocks.pack_with_mins(weight) (a GGUF Q5_K GGUFWeight), after `load`."""
    load()
    return cpu_q8_blocks.pack_with_mins(weight)


def check_x(op: str, x: torch.Tensor, rows: int | None, block: int = BLOCK) -> None:
    """ValueError naming `op` unless x is [rows, K] (any M for rows None) on the CPU with K a multiple
    of `block` (32 for Q8_0 activations, 256 for Q8_K: cpu_kquants_a8)."""
    if x.dim() != 2 or (rows is not None and x.shape[0] != rows) or x.shape[1] % block:
        want = "[1, K]" if rows == 1 else "[M, K]"
        raise ValueError(f"{op}: x must be {want} with K a multiple of {block}, got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{op}: x must be on the CPU, got {x.device}")


def quantize_tensor_form(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The native quantizers' arithmetic as tensor code: x float32 [M, K] -> (q int8 [M, K], d float32
    [M, K / block]), per `block` values d = max|x| / 127 and q = round(x / d) half away from zero;
    d = NaN and q = 0 for a block with a NaN or an infinity."""
    m, k = x.shape
    blocks = x.view(m, k // block, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    scaled = blocks * torch.where(d == 0, 0.0, 1.0 / d)
    a = scaled.abs()  # round half away from zero as gguf's np_roundf (a + 0.5 can round up in float32)
    q = (scaled.sign() * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8)
    bad = ~blocks.isfinite().all(-1, keepdim=True)
    q = q.masked_fill(bad, 0)
    d = d.masked_fill(bad, float("nan"))
    return q.view(m, k), d.view(m, k // block)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] (read as float32), K a multiple of 32 -> (q int8 [M, K], d float32 [M, K / 32]):
    per block of 32, d = max|x| / 127 and q = round(x / d), half away from zero (gguf's Q8_0 values;
    d kept in float32). A block holding a NaN or an infinity gets d = NaN and q = 0."""
    check_x("quantize_q8_0", x, None)
    x = x.float().contiguous()
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return torch.ops.kiln_cpu.quantize_q8_0(x)
    return quantize_tensor_form(x)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The x' = d * q that `quantize_q8_0`'s (q [M, K], d [M, K / 32]) stand for, float32 [M, K]; d's
    width gives the block (cpu_kquants_a8's Q8_K: K / 256)."""
    m, k = q.shape
    blocks = d.shape[1]
    return (q.view(m, blocks, k // blocks).float() * d.view(m, blocks, 1)).view(m, k)


def q8_0_reference(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) as the a8 kernels see it, float64: the int8 values of gguf's own
    Q8_0 quantizer (the `gguf` package, ggml's reference rounding) times the float32 scale
    max|x| / 127 of each block (which gguf would round to float16); NaN for a block with a NaN or an
    infinity. The verifier's reference for the "*_a8_onednn" layouts, written without Kiln's
    quantizer where `gguf` is installed (a core dependency; the GPU image lacks it, and there the
    tensor form stands in)."""
    return int8_reference(x, BLOCK)


def int8_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] quantized per `block` values (32: Q8_0; 256: Q8_K, cpu_kquants_a8) and read back,
    float64: gguf's Q8_0 rounding (quantize_blocks, applied to whole blocks of that size) times the
    float32 max|x| / 127 of each block; NaN for a block with a NaN or an infinity; the tensor form
    where `gguf` is not installed."""
    m, k = x.shape
    blocks = x.detach().float().cpu().reshape(m * k // block, block)
    finite = blocks.isfinite().all(-1, keepdim=True)
    try:
        from gguf import quants
    except ImportError:
        q = quantize_tensor_form(blocks.reshape(m, k), block)[0].view(-1, block)
    else:
        data = quants.Q8_0.quantize_blocks(blocks.masked_fill(~finite, 0).numpy())  # [blocks, 2 + block]
        q = torch.from_numpy(data[:, 2:].copy()).view(torch.int8)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    xq = (q.to(torch.float64) * d.to(torch.float64)).masked_fill(~finite, float("nan"))
    return xq.view(m, k).to(x.device)


def q4_blocks_a8_gemv(
    x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """x [1, K] float (read as float32), nibbles uint8 [N, K / 2], scales and mins float32 [N, K / 32]
    (cpu_q4_blocks.pack) -> y float32 [1, N] = x' @ W^T, x' = x quantized to Q8_0 (`quantize_q8_0`)."""
    x = x.float()  # the native op checks its arguments (one call per projection per step)
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return torch.ops.kiln_cpu.q4_blocks_a8_gemv(x, nibbles, scales, mins)
    check_x("q4_blocks_a8_gemv", x, 1)
    q, d = quantize_tensor_form(x.contiguous())
    return cpu_q4_blocks.q4_blocks_gemv(dequantize_q8_0(q, d), nibbles, scales, mins)


def q8_blocks_a8_gemv(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [1, K] float (read as float32), values int8 [N, K], scales float32 [N, K / 32] or [N, K / 16]
    (cpu_q8_blocks.pack) -> y float32 [1, N] = x' @ W^T, x' = x quantized to Q8_0 (`quantize_q8_0`)."""
    x = x.float()  # the native op checks its arguments (one call per projection per step)
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return torch.ops.kiln_cpu.q8_blocks_a8_gemv(x, values, scales)
    return _q8_a8_tensors("q8_blocks_a8_gemv", x, values, scales, None)


def q8_blocks_mins_a8_gemv(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """`q8_blocks_a8_gemv` with a min per block of the scales (mins float32, the scales' shape: Q5_K's,
    a stacked weight's): y = x' @ W^T with W = values * scale + min."""
    x = x.float()
    if not torch.compiler.is_compiling():
        load()
    if _state["loaded"]:
        return torch.ops.kiln_cpu.q8_blocks_mins_a8_gemv(x, values, scales, mins)
    return _q8_a8_tensors("q8_blocks_mins_a8_gemv", x, values, scales, mins)


def _q8_a8_tensors(op, x, values, scales, mins) -> torch.Tensor:
    """The Q8 a8 kernels as tensor code (no native library): x' times the float32 matrix."""
    check_x(op, x, 1)
    q, d = quantize_tensor_form(x.contiguous())
    n, k = values.shape
    w = values.view(n, scales.shape[1], -1).float() * scales.view(n, -1, 1)
    if mins is not None:
        w = w + mins.view(n, -1, 1)
    return dequantize_q8_0(q, d) @ w.view(n, k).T
