"""Triton fp8_block_linear: activation quantization fused into a block-scaled FP8 GEMM.

A program owns a [BLOCK_M, BLOCK_N] output tile and walks K one weight block (block_k inputs) at a
time: it loads the x tile, takes each row's amax over the group, rounds x / s to e4m3 in registers
(scaled_triton's exact round-to-nearest-even), multiplies it with the e4m3 weight tile in an fp8
tl.dot (float32 result), and accumulates that times s[m] * w_scale[n // block_n, g] in float32.
x is read once per N tile and never written back quantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.gemm.fp8_block_linear.spec import FP8_BLOCK_LINEAR
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_MAX
from kiln.ops.gemm.scaled_triton import _round_to_e4m3
from kiln.ops.registry import Implementation, triton_available


@triton.jit
def _fp8_block_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    block_n,
    fp8_max,
    amax_floor,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // block_n).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, GROUP_K)):
        offs_k = g * GROUP_K + tl.arange(0, GROUP_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        x = x.to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), amax_floor) / fp8_max
        v = tl.minimum(tl.maximum(x / x_scale[:, None], -fp8_max), fp8_max)
        x_q = _round_to_e4m3(v).to(tl.float8e4nv)
        w = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w_scale = tl.load(s_rows + g, mask=n_mask, other=0.0)
        if GROUP_K < 32:  # Triton's 8-bit dots need K >= 32; every e4m3 value is a float16 value
            part = tl.dot(x_q.to(tl.float16), w.to(tl.float16), out_dtype=tl.float32)
        else:  # promote to float32 after every k32 wgmma (see scaled_triton)
            part = tl.dot(x_q, w, out_dtype=tl.float32, max_num_imprecise_acc=32)
        acc += part * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_linear_triton(x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=torch.bfloat16):
    M, K = x.shape
    N = w_fp8.shape[0]
    out = empty((M, N), out_dtype, x.device)
    if M == 0 or N == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_fp8 = w_fp8 if w_fp8.stride(-1) == 1 else w_fp8.contiguous()
    w_scale = w_scale.float().contiguous()
    block_m = 16 if M <= 16 else 64
    block_n_tile = 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n_tile))
    _fp8_block_linear_kernel[grid](
        x,
        w_fp8,
        w_scale,
        bias.contiguous() if bias is not None else out,
        out,
        M,
        N,
        K,
        x.stride(0),
        w_fp8.stride(0),
        w_scale.stride(0),
        out.stride(0),
        block_n,
        FP8_MAX,
        AMAX_FLOOR,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n_tile,
        GROUP_K=block_k,
        num_warps=4,
    )
    return out


FP8_BLOCK_LINEAR.register(
    Implementation("triton", fp8_block_linear_triton, triton_available,
                   description="x quantized per token and group in registers, fp8 tl.dot per weight block")
)  # fmt: skip
