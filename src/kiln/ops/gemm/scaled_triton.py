"""Triton W8A8 kernels shared by FP8 (e4m3) and INT8: activation quantization and the scaled GEMM.
quantize_fp8, quantize_int8, fp8_linear and int8_linear (their triton.py) launch these.

Quantization: one program per row. Per token, the program finds the row's amax, writes the scale
and writes the rounded row (amax + scale + cast fused in one kernel). Per tensor needs the amax of
the whole tensor before any element can be cast, and programs cannot wait for each other, so a
first kernel reduces row maxima into one float32 with atomic_max and the second casts.

Rounding is done explicitly in float32 before the cast, so the cast itself is exact: e4m3 by
round-to-nearest-even on the float32 bits (keeping 3 of 23 mantissa bits; the carry into the exponent
is what the bit trick gets right), int8 half away from zero. (The Triton interpreter's own
float32 -> fp8 cast halves values that round up to a power of two; an exact cast avoids it.)

GEMM: the tiled/grouped/split-K scheme of tiling.py with int32 (INT8) or float32 (FP8) accumulators;
the epilogue multiplies by x_scale[m] * w_scale[n] (per-tensor scales broadcast), then adds the bias.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.gemm.scaled import AMAX_FLOOR
from kiln.ops.gemm.tiling import (
    config_space,
    launch_grid,
    nothing_to_multiply,
    partials_buffer,
    reduce_split_k,
    resolve_config,
    store_tile,
    tile_options,
    tile_program,
)

MAX_BLOCK = 4096


@triton.jit
def _round_to_e4m3(v):
    """Round float32 v (|v| <= 448) to the nearest e4m3 value, ties to even, still in float32."""
    bits = v.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = ((bits >> 20) << 20).to(tl.float32, bitcast=True)
    # Below 2^-6 e4m3 is subnormal with a fixed step of 2^-9: adding 1.5 * 2^14 (whose float32 ulp is
    # 2^-9) makes the float32 adder round to that step.
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _row_amax(x_row, K, BLOCK: tl.constexpr):
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)))
    return tl.max(amax, axis=0)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, K, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.atomic_max(amax_ptr, _row_amax(x_ptr + row * stride_xm, K, BLOCK))


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    amax_ptr,
    K,
    stride_xm,
    stride_qm,
    qmax,
    amax_floor,
    PER_TOKEN: tl.constexpr,
    IS_INT8: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if PER_TOKEN:
        amax = _row_amax(x_row, K, BLOCK)
    else:
        amax = tl.load(amax_ptr)
    # div_rn: IEEE round-to-nearest, as torch divides in the reference. Triton's `/` on float32 is
    # div.full.f32 (~2 ulp): an x / s one ulp off next to a rounding boundary picks the other code
    # (fp8_block_linear's quantizer, H200: one element 4.9e-3 of max |ref| off).
    scale = tl.math.div_rn(tl.maximum(amax, amax_floor), qmax)
    if PER_TOKEN:
        tl.store(scale_ptr + row, scale)
    else:
        if row == 0:
            tl.store(scale_ptr, scale)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        mask = cols < K
        v = tl.math.div_rn(tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32), scale)
        v = tl.minimum(tl.maximum(v, -qmax), qmax)
        if IS_INT8:
            v = tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))
        else:
            v = _round_to_e4m3(v)
        tl.store(q_ptr + row * stride_qm + cols, v.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x, per_token: bool, qdtype: torch.dtype, qmax: float):
    """x [M, K] -> (q [M, K] of qdtype, float32 scale [M, 1] per token or [1] per tensor), with
    scale = max(amax, AMAX_FLOOR) / qmax; fp8 rounds to nearest even, int8 half away from zero."""
    M, K = x.shape
    q = empty((M, K), qdtype, x.device)
    scale = empty((M, 1) if per_token else (1,), torch.float32, x.device)
    if M == 0:
        return q, scale
    x = x if x.stride(-1) == 1 else x.contiguous()
    block = min(triton.next_power_of_2(max(K, 1)), MAX_BLOCK)
    amax = None
    if not per_token:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        _amax_kernel[(M,)](x, amax, K, x.stride(0), BLOCK=block)
    _quantize_rows_kernel[(M,)](
        x,
        q,
        scale,
        amax if amax is not None else scale,
        K,
        x.stride(0),
        q.stride(0),
        qmax,
        AMAX_FLOOR,
        PER_TOKEN=per_token,
        IS_INT8=qdtype == torch.int8,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 8),
    )
    return q, scale


@triton.jit
def _scaled_linear_kernel(
    x_ptr,
    w_ptr,
    x_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    X_PER_TOKEN: tl.constexpr,
    W_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    offs_m, offs_n, m_mask, n_mask, pid_k, k_start, k_end = tile_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K
    )
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=ZERO)
        b = tl.load(w_cols + offs_k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=ZERO)
        if ACC_DTYPE == tl.int32:
            acc = tl.dot(a, b, acc, out_dtype=ACC_DTYPE)  # triton 3.6 does not infer int32 from acc
        else:
            # fp8 on sm_90: without this, wgmma chains the accumulator through the tensor core's
            # reduced-precision adder (~13 mantissa bits) for the whole K loop; 32 adds it into
            # float32 after every k32 wgmma (DeepSeek-V3's promotion)
            acc = tl.dot(a, b, acc, out_dtype=ACC_DTYPE, max_num_imprecise_acc=32)
    if X_PER_TOKEN:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
    else:
        x_scale = tl.load(x_scale_ptr + offs_m * 0)
    if W_PER_CHANNEL:
        w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    else:
        w_scale = tl.load(w_scale_ptr + offs_n * 0)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    store_tile(
        out,
        out_ptr,
        bias_ptr,
        partial_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_om,
        stride_on,
        pid_k,
        HAS_BIAS,
        SPLIT_K,
    )


def scaled_linear(op, x_q, x_scale, w_q, w_scale, bias, out_dtype, config):
    """(x_q [M, K] * x_scale) @ (w_q [N, K] * w_scale)^T + bias -> [M, N] in out_dtype; int32
    accumulation for int8 operands, float32 for fp8; `config` None: tuned or heuristic."""
    M, K = x_q.shape
    N = w_q.shape[0]
    out = empty((M, N), out_dtype, x_q.device)
    if (done := nothing_to_multiply(out, x_q.shape, bias)) is not None:
        return done
    shape = {"M": M, "N": N, "K": K, "per_token": x_scale.dim() == 2}
    cfg = resolve_config(op, out_dtype, shape, config, x_q.device, min_block_k=32, byte_operands=True)
    partials = partials_buffer(cfg, M, N, x_q.device)
    x_scale = x_scale.float().contiguous()
    w_scale = w_scale.float().contiguous()
    _scaled_linear_kernel[launch_grid(cfg, M, N)](
        x_q,
        w_q,
        x_scale,
        w_scale,
        bias.contiguous() if bias is not None else out,
        out,
        partials if partials is not None else out,
        M,
        N,
        K,
        x_q.stride(0),
        x_q.stride(1),
        w_q.stride(0),
        w_q.stride(1),
        out.stride(0),
        out.stride(1),
        X_PER_TOKEN=x_scale.dim() == 2,
        W_PER_CHANNEL=w_scale.dim() == 2,
        HAS_BIAS=bias is not None,
        ACC_DTYPE=tl.int32 if x_q.dtype == torch.int8 else tl.float32,
        ZERO=0 if x_q.dtype == torch.int8 else 0.0,  # the masked-load fill must have the operand's kind
        **tile_options(cfg),
    )
    reduce_split_k(partials, out, bias)
    return out


def scaled_linear_configs(shape, dtype):
    """The tuning space: tl.dot on 8-bit operands needs BLOCK_K >= 32."""
    return config_space(shape, dtype, min_block_k=32)
