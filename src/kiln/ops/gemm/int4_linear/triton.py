"""Triton W4A16 GEMM (`int4_linear`): int4 weights dequantized in registers, never in memory.

Same tiling as the dense GEMM (grouped order, split-K for small M; see ../tiling.py). Per BLOCK_K step a
program loads its x tile [BLOCK_M, BLOCK_K] and the packed words of its weight tile, [BLOCK_K / 8,
BLOCK_N] (each column n's words are contiguous in memory: whole sectors, each word loaded once), splits
every word into its 8 nibbles ([BLOCK_K / 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]), forms
(q - zero) * scale in float32, rounds it to x's dtype and takes tl.dot(x, w). The packed bytes are all
that cross from memory. (The transposed orientation, [BLOCK_N, BLOCK_K] then tl.trans, compiled for
sm_90 at 240-255 registers against 64-72 for this one at 16x64x64.)

The first version loaded a [BLOCK_K, BLOCK_N] tile of words (word k // 8 for each k): every word 8
times, 32 rows 2 KB apart per warp load. On an H200 it ran at 38 GB/s (M = 1, N = 6144, K = 4096:
348 us, bf16 cuBLAS on the dense weight 16 us).
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
    nothing_to_multiply,
    partials_buffer,
    reduce_split_k,
    resolve_config,
    store_tile,
    tile_options,
    tile_program,
)
from kiln.ops.registry import Implementation, triton_available

MAX_BLOCK_K = {False: 64, True: 32}  # by wide (float32) operands; see int4_linear_triton


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
    shifts = tl.arange(0, 8) * 4  # nibble i of a word is k = 8j + i
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):  # k0 is a multiple of BLOCK_K, hence of 8
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # k0 is a multiple of BLOCK_K: each column's BLOCK_K / 8 words start aligned (vector loads)
        offs_w = tl.max_contiguous(
            tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), BLOCK_K // 8), BLOCK_K // 8
        )
        # a word holding any k < k_end; its nibbles past K meet x's zeros
        w_mask = (offs_w * 8 < k_end)[:, None] & n_mask[None, :]
        words = tl.load(qweight_ptr + n64 * stride_qn + offs_w[:, None], mask=w_mask, other=0)
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        if GROUP_SIZE % BLOCK_K == 0:  # the whole K tile lies in one group: one scale/zero per column
            group = k0 // GROUP_SIZE
            scale = tl.load(scales_ptr + n64 * stride_sn + group, mask=n_mask[None, :], other=0.0)
            zero = tl.load(zeros_ptr + n64 * stride_zn + group, mask=n_mask[None, :], other=0)
        else:  # BLOCK_K / GROUP_SIZE whole groups (both powers of two): each column's few, broadcast
            groups = k0 // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
            g_mask = (groups * GROUP_SIZE < k_end)[:, None] & n_mask[None, :]
            scale = tl.load(scales_ptr + n64 * stride_sn + groups[:, None], mask=g_mask, other=0.0)
            zero = tl.load(zeros_ptr + n64 * stride_zn + groups[:, None], mask=g_mask, other=0)
            scale = tl.reshape(
                tl.broadcast_to(scale[:, None, :], (BLOCK_K // GROUP_SIZE, GROUP_SIZE, BLOCK_N)),
                (BLOCK_K, BLOCK_N),
            )
            zero = tl.reshape(
                tl.broadcast_to(zero[:, None, :], (BLOCK_K // GROUP_SIZE, GROUP_SIZE, BLOCK_N)),
                (BLOCK_K, BLOCK_N),
            )
        # Past K the x tile is 0, so whatever finite w those lanes get adds nothing.
        w = ((q - zero.to(tl.int32)).to(tl.float32) * scale.to(tl.float32)).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, out_ptr, partial_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
               False, SPLIT_K)  # fmt: skip


def int4_linear_triton(x, qweight, scales, zeros, group_size, config: dict | None = None):
    K = x.shape[-1]
    x2 = as_rows(x)
    M, N = x2.shape[0], qweight.shape[0]
    out = empty((M, N), x.dtype, x.device)
    if (done := nothing_to_multiply(out, x.shape, None)) is not None:
        return done
    qweight, scales, zeros = contiguous_rows(qweight), contiguous_rows(scales), contiguous_rows(zeros)
    shape = {"M": M, "N": N, "K": K, "group_size": group_size}
    # K tiles of up to 64 inputs (float32 x: 32, its ieee dot's registers): 8 words of a column per step
    wide = x.dtype == torch.float32
    cfg = resolve_config(
        "int4_linear", x.dtype, shape, config, x.device, wide_operands=wide, max_block_k=MAX_BLOCK_K[wide]
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
