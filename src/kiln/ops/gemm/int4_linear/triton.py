"""Triton W4A16 GEMM (`int4_linear`): int4 weights dequantized in registers, never in memory.

Same tiling as the dense GEMM (grouped order, split-K for small M; see ../tiling.py). Per BLOCK_K step a
program loads its x tile and, for the weight tile [BLOCK_K, BLOCK_N], the int32 word holding each
nibble (word k // 8 of row n; the 8 nibbles of a word hit the same cache line), shifts the nibble
out, gathers its group's scale and zero point, forms (q - zero) * scale in float32 and rounds it
to x's dtype for tl.dot. The packed bytes are all that cross from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows, contiguous_rows
from kiln.ops.gemm.int4_linear.spec import INT4_LINEAR
from kiln.ops.gemm.tiling import (
    config_space,
    launch_grid,
    partials_buffer,
    reduce_split_k,
    resolve_config,
    store_tile,
    tile_options,
    tile_program,
)
from kiln.ops.registry import Implementation, triton_available


@triton.jit
def _int4_linear_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, partial_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_zn, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, m_mask, n_mask, pid_k, k_start, k_end = tile_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K
    )
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    n64 = offs_n[None, :].to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(qweight_ptr + n64 * stride_qn + (offs_k // 8)[:, None], mask=w_mask, other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if GROUP_SIZE % BLOCK_K == 0:  # the whole K tile lies in one group: one scale/zero per column
            group = k0 // GROUP_SIZE
            scale = tl.load(scales_ptr + n64 * stride_sn + group, mask=n_mask[None, :], other=0.0).to(
                tl.float32
            )
            zero = tl.load(zeros_ptr + n64 * stride_zn + group, mask=n_mask[None, :], other=0).to(tl.int32)
        else:
            group = (offs_k // GROUP_SIZE)[:, None]
            scale = tl.load(scales_ptr + n64 * stride_sn + group, mask=w_mask, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + n64 * stride_zn + group, mask=w_mask, other=0).to(tl.int32)
        # Past K the x tile is 0, so whatever finite w those lanes get adds nothing.
        w = ((q - zero).to(tl.float32) * scale).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, out_ptr, partial_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
               False, SPLIT_K)  # fmt: skip


def int4_linear_triton(x, qweight, scales, zeros, group_size, config: dict | None = None):
    K = x.shape[-1]
    x2 = as_rows(x)
    M, N = x2.shape[0], qweight.shape[0]
    out = empty((M, N), x.dtype, x.device)
    if M == 0 or N == 0 or K == 0:
        return (out if M == 0 or N == 0 else out.zero_()).reshape(*x.shape[:-1], N)
    qweight, scales, zeros = contiguous_rows(qweight), contiguous_rows(scales), contiguous_rows(zeros)
    shape = {"M": M, "N": N, "K": K, "group_size": group_size}
    # By default a K tile stays inside one quantization group (one scale and zero per column per step),
    # and is at most 32 deep: the dequantized [BLOCK_K, BLOCK_N] fp32 tile lives in registers, and with
    # BLOCK_K 64-128 Triton 3.6 spills them on sm_90 (1.5 KB at 16x64x128; python -m kiln.tune.aot).
    wide = x.dtype == torch.float32
    cfg = resolve_config(
        "int4_linear", x.dtype, shape, config, x.device, wide_operands=wide, max_block_k=min(group_size, 32)
    )
    partials = partials_buffer(cfg, M, N, x.device)
    _int4_linear_kernel[launch_grid(cfg, M, N)](
        x2, qweight, scales, zeros, out, partials if partials is not None else out,
        M, N, K,
        x2.stride(0), x2.stride(1), qweight.stride(0), scales.stride(0), zeros.stride(0),
        out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **tile_options(cfg),
    )  # fmt: skip
    reduce_split_k(partials, out, None)
    return out.reshape(*x.shape[:-1], N)


INT4_LINEAR.register(
    Implementation("triton", int4_linear_triton, triton_available, configs=config_space,
                   description="in-register int4 dequant (group scales + zero points), split-K for small M")
)  # fmt: skip
