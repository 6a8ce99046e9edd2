"""Triton fp8_block_linear: block-scaled FP8 GEMM with the activations quantized per token and group.

The GEMM uses the tiling of ../tiling.py (grouped program order, split-K for small M with float32
partials summed by `reduce_split_k`, so results stay deterministic). One K step is one group of
block_k inputs: each group has its own x scale s[m, g] and weight scale w_scale[n // block_n, g], so
the step's fp8 tl.dot starts from zero (float32 result) and is added to the accumulator times
s[m] * w_scale[n]. A BLOCK_N tile may span several block_n rows of weight scales (loaded per column).

x is quantized with scaled_triton's exact float32 rounding (round-to-nearest-even to e4m3) either
  * in registers, per tile (M <= IN_REGISTER_MAX_M, decode): one launch, x is tiny, the kernel is bound
    by streaming the weight; or
  * first, by `_quantize_groups_kernel` into x_q [M, G * block_k] e4m3 and s [G, M] float32 (prefill):
    a program would otherwise redo the amax, the division and the rounding of its x tile for each of
    the N / BLOCK_N column tiles, which costs several times the tensor-core work of the tile.
Both give the same bits: the same float32 operations on the same values.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.gemm.fp8_block_linear.spec import FP8_BLOCK_LINEAR
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from kiln.ops.gemm.scaled_triton import _round_to_e4m3
from kiln.ops.gemm.tiling import (
    CONFIG_KEYS,
    SHARED_MEMORY_BUDGET,
    nothing_to_multiply,
    num_sms,
    partials_buffer,
    pow2_at_least,
    reduce_split_k,
    split_k_to_fill,
    store_tile,
    tile_config,
    tile_options,
    tile_program,
)
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.tuned_configs import lookup

IN_REGISTER_MAX_M = 16  # above: quantize x in its own kernel first (see the module docstring)


@triton.jit
def _quantize_tile(x, fp8_max, amax_floor):
    """float32 [BLOCK_M, GROUP_K] -> (e4m3 tile, float32 scale per row): s = max(amax, floor) / fp8_max.
    Both divisions are IEEE round-to-nearest (div_rn, as torch divides in the reference): Triton's `/`
    on float32 is div.full.f32 (approximate, ~2 ulp), and an x / s an ulp off next to an e4m3 rounding
    boundary rounds to the other neighbour. With `/`, a float32 case (M=300, N=520, K=384) failed on an
    H200: one element off by 5e-3 of max |ref| (bound 2e-4)."""
    x_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), amax_floor), fp8_max)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, x_scale[:, None]), -fp8_max), fp8_max)
    return _round_to_e4m3(v).to(tl.float8e4nv), x_scale


@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    xq_ptr,
    xs_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    fp8_max,
    amax_floor,
    BLOCK_M: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    """Program (i, g): rows [i * BLOCK_M, ...) of group g -> x_q (zeros past K, so the GEMM reads
    whole groups unmasked) and s[g, m] (transposed: a GEMM step loads its group's scales contiguously)."""
    g = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = g * GROUP_K + tl.arange(0, GROUP_K)
    m_mask = offs_m < M
    rows = offs_m[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                other=0.0)  # fmt: skip
    x_q, x_scale = _quantize_tile(x.to(tl.float32), fp8_max, amax_floor)
    tl.store(xq_ptr + rows * stride_qm + offs_k[None, :], x_q, mask=m_mask[:, None])
    tl.store(xs_ptr + g.to(tl.int64) * M + offs_m, x_scale, mask=m_mask)


@triton.jit
def _fp8_block_linear_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
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
    PREQUANTIZED: tl.constexpr,
    W_SCALE_PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # BLOCK_K is the weight's block_k: K splits and steps fall on group boundaries.
    offs_m, offs_n, m_mask, n_mask, pid_k, k_start, k_end = tile_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K
    )
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    if W_SCALE_PER_TILE:  # the tile lies inside one block_n row of scales: one scale per step
        s_rows = s_ptr + (tl.min(offs_n, axis=0) // block_n).to(tl.int64) * stride_sn
    else:  # one scale row per column
        s_rows = s_ptr + (offs_n // block_n).to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        g = k0 // BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if PREQUANTIZED:  # x_q holds whole groups (zero-padded past K)
            x_q = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            x_scale = tl.load(xs_ptr + g * M + offs_m, mask=m_mask, other=0.0)
        else:
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            x_q, x_scale = _quantize_tile(x.to(tl.float32), fp8_max, amax_floor)
        w = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BLOCK_K < 32:  # Triton's 8-bit dots need K >= 32; every e4m3 value is a float16 value
            part = tl.dot(x_q.to(tl.float16), w.to(tl.float16), out_dtype=tl.float32)
        else:  # promote to float32 after every k32 wgmma (see scaled_triton)
            part = tl.dot(x_q, w, out_dtype=tl.float32, max_num_imprecise_acc=32)
        if W_SCALE_PER_TILE:
            w_scale = tl.load(s_rows + g)
            acc += part * x_scale[:, None] * w_scale
        else:
            w_scale = tl.load(s_rows + g, mask=n_mask, other=0.0)
            acc += part * x_scale[:, None] * w_scale[None, :]
    store_tile(acc, out_ptr, bias_ptr, partial_ptr, offs_m, offs_n, M, N, stride_om, 1, pid_k,
               HAS_BIAS, SPLIT_K)  # fmt: skip


def heuristic_config(
    M: int, N: int, K: int, block_k: int, device: torch.device, out_dtype: torch.dtype = torch.bfloat16
) -> dict:
    """Measured on an H200 (Llama-3-8B projections). An fp8 dot with max_num_imprecise_acc=32 keeps two
    float32 tiles besides the accumulator (its result and each k32 step's partial), so a thread holds at
    most 32 values of each: 64 (128 x 128 on 8 warps, 64 x 128 on 4) spills on sm_90.
      M <= 16 (x quantized in registers): 16 x 128, 4 warps, split-K up to ~3 programs per SM
              (M=1: N=6144 12.6 us, N=28672 45 us, K=14336 25.5 us: ~2 TB/s of weight).
      M <= 64: 64 x 128 on 8 warps (two warpgroups of m64n64), split-K up to one program per SM.
      larger: 64 x 128 on 8 warps, or 256 x 64 on 16 warps where its tiles fill the GPU."""
    if M <= IN_REGISTER_MAX_M:
        block_m, block_n, num_warps, num_stages, programs_per_sm = 16, 128, 4, 3, 3
    elif M <= 64:
        block_m, block_n, num_warps, num_stages, programs_per_sm = 64, 128, 8, 4, 1
    else:
        block_m, block_n, num_warps, num_stages, programs_per_sm = 64, 128, 8, 4, 0
        # 256 x 64 on 16 warps (four warpgroups of m64n64, 128 registers a thread): fewer loads per FLOP
        # than 64 x 128 (H200: 526 against 430 TFLOP/s at M=2048), once its tiles fill the GPU. With a
        # float32 output its epilogue needs a few more registers: it spills 16 bytes (an in-loop reload)
        wide = triton.cdiv(M, 256) * triton.cdiv(N, 64) * 3 >= 2 * num_sms(device)
        if wide and out_dtype != torch.float32:
            block_m, block_n, num_warps, num_stages = 256, 64, 16, 3
    if block_k < 128:  # thin groups: more steps in flight
        num_stages += 1
    block_m = min(block_m, pow2_at_least(M, 16))
    block_n = min(block_n, pow2_at_least(N, 16))  # never wider than the layer (tiny layers, interpreter)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split_k = split_k_to_fill(tiles, triton.cdiv(K, block_k), programs_per_sm * num_sms(device))
    return tile_config(block_m, block_n, block_k, split_k, num_warps, num_stages)


def fp8_block_configs(shape: dict, dtype: torch.dtype) -> list[dict]:
    """The `kiln tune` space: BLOCK_K is fixed to the weight's block_k; the e4m3 x and w tiles of every
    stage fit in shared memory, and each float32 tile holds at most 32 values per thread (see
    `heuristic_config`: the dot keeps three such tiles)."""
    M, N, block_k = shape["M"], shape["N"], shape.get("block_k", 128)
    small = M <= 64
    block_ms, split_ks = ([16, 32, 64], [1, 2, 4, 8, 16]) if small else ([64, 128], [1])
    configs = []
    space = itertools.product(block_ms, [64, 128, 256], split_ks, [4, 8, 16], [3, 4, 5])
    for bm, bn, sk, warps, stages in space:
        if bm > pow2_at_least(M, 16) or bn > pow2_at_least(N, 16) or bm * bn > 32 * 32 * warps:
            continue
        if (bm + bn) * block_k * stages > SHARED_MEMORY_BUDGET:
            continue
        configs.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k, "GROUP_M": 8, "SPLIT_K": sk,
                        "num_warps": warps, "num_stages": stages})  # fmt: skip
    return configs


def _resolve_config(shape: dict, dtype: torch.dtype, config: dict | None, device: torch.device) -> dict:
    """The caller's config, else the tuning cache's, else the heuristic."""
    if config is None:
        config = lookup("fp8_block_linear", dtype, shape, device)
    if config is None:
        return heuristic_config(shape["M"], shape["N"], shape["K"], shape["block_k"], device, dtype)
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"fp8_block_linear: config {config} is missing {', '.join(missing)}")
    if config["BLOCK_K"] != shape["block_k"]:
        raise ValueError(
            f"fp8_block_linear: config BLOCK_K={config['BLOCK_K']} must equal the weight's block_k "
            f"{shape['block_k']} (one K step per weight block)"
        )
    if min(config["BLOCK_M"], config["BLOCK_N"]) < 16:
        raise ValueError(f"fp8_block_linear: config blocks must be >= 16 (tl.dot), got {config}")
    return dict(config)


def quantize_groups(x: torch.Tensor, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, G * block_k] e4m3, zeros past K; s [G, M] float32), G = ceil(K / block_k)."""
    M, K = x.shape
    groups = triton.cdiv(K, block_k)
    x_q = empty((M, groups * block_k), FP8_DTYPE, x.device)
    x_scale = empty((groups, M), torch.float32, x.device)
    block_m = 32 if block_k >= 128 else 64
    _quantize_groups_kernel[(triton.cdiv(M, block_m), groups)](
        x, x_q, x_scale, M, K, x.stride(0), x_q.stride(0), FP8_MAX, AMAX_FLOOR,
        BLOCK_M=block_m, GROUP_K=block_k, num_warps=4,
    )  # fmt: skip
    return x_q, x_scale


def fp8_block_linear_triton(
    x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=torch.bfloat16, config: dict | None = None
):
    M, K = x.shape
    N = w_fp8.shape[0]
    out = empty((M, N), out_dtype, x.device)
    if (done := nothing_to_multiply(out, x.shape, bias)) is not None:
        return done
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_fp8 = w_fp8 if w_fp8.stride(-1) == 1 else w_fp8.contiguous()
    w_scale = w_scale.float().contiguous()
    bias = bias.contiguous() if bias is not None else None
    shape = {"M": M, "N": N, "K": K, "block_n": block_n, "block_k": block_k}
    cfg = _resolve_config(shape, out_dtype, config, x.device)
    prequantized = M > IN_REGISTER_MAX_M
    if prequantized:
        x, x_scale = quantize_groups(x, block_k)
    partials = partials_buffer(cfg, M, N, x.device)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    _fp8_block_linear_kernel[grid](
        x,
        x_scale if prequantized else out,
        w_fp8,
        w_scale,
        bias if bias is not None else out,
        out,
        partials if partials is not None else out,
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
        PREQUANTIZED=prequantized,
        W_SCALE_PER_TILE=block_n % cfg["BLOCK_N"] == 0,
        HAS_BIAS=bias is not None,
        **tile_options(cfg),
    )
    reduce_split_k(partials, out, bias)
    return out


FP8_BLOCK_LINEAR.register(
    Implementation("triton", fp8_block_linear_triton, triton_available, configs=fp8_block_configs,
                   description="block-scaled fp8 tl.dot per weight group, grouped tiles, split-K for decode; "
                               "x quantized in registers (decode) or by a group quantizer first (prefill)")
)  # fmt: skip
