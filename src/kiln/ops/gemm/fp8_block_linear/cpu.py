"""CPU fp8_block_linear: x quantized per token and group in float32 (the spec's definition), the weight
dequantized to float32, one float32 GEMM. The engine does not call this on the CPU (the loader
dequantizes block-FP8 weights once; kiln.ops.gemm.quantized_layouts runs quantize_dequantize_groups
on x); it is the op's CPU path for `kiln verify` and for tests. Its quantizer is its own, not the
spec's reference, so that `kiln verify` checks one against the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.fp8_block_linear.spec import FP8_BLOCK_LINEAR
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from kiln.ops.registry import Implementation, cpu_only


def quantize_dequantize_groups(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [M, K] -> x_q * s [M, K], x quantized to e4m3 per token and group of block_k inputs (s = the
    group's amax / 448), in float32 (float64 for float64 x). The quotient x / s is taken in float32, as
    every backend takes it: an fp16 / bf16 x / s on an e4m3 rounding tie rounds as that quotient does."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    M, K = x.shape
    pad = -K % block_k  # zeros: they change no group's amax
    groups = F.pad(x.to(torch.float32), (0, pad)).reshape(M, (K + pad) // block_k, block_k)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    x_q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (x_q.to(compute) * scale.to(compute)).reshape(M, K + pad)[:, :K]


def dequantize_weight(w_fp8, w_scale, block_n: int, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """w_fp8 [N, K] e4m3 times its block's scale w_scale[n // block_n, k // block_k], [N, K] in dtype."""
    N, K = w_fp8.shape
    rows = torch.arange(N, device=w_fp8.device) // block_n
    cols = torch.arange(K, device=w_fp8.device) // block_k
    return w_fp8.to(dtype) * w_scale.to(dtype)[rows][:, cols]


def fp8_block_linear_cpu(x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=torch.bfloat16):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_weight(w_fp8, w_scale, block_n, block_k, compute)
    y = F.linear(quantize_dequantize_groups(x, block_k), w, None if bias is None else bias.to(compute))
    return y.to(out_dtype)


FP8_BLOCK_LINEAR.register(Implementation("cpu", fp8_block_linear_cpu, cpu_only))
