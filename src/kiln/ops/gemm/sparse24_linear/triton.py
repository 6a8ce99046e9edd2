"""Triton 2:4 sparse GEMM (`sparse24_linear`): the weight expanded in registers, never in memory.

Same tiling as the dense GEMM (grouped order, split-K for small M; see ../tiling.py). Per BLOCK_K step
a program loads its x tile and builds the dense weight tile [BLOCK_K, BLOCK_N]: dense column k of row
n is group g = k // 4 at position k % 4; the group's two kept values sit at values[n, 2g] and
values[n, 2g + 1], its positions in nibble g % 2 of byte meta[n, k // 8]. Each lane picks the kept
value whose position is its own, else 0. The four lanes of a group read the same
two values and the eight lanes of a byte the same byte, so the loads hit the cache: only the
compressed bytes cross from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows, contiguous_rows
from kiln.ops.gemm.sparse24_linear.spec import SPARSE24_LINEAR
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


@triton.jit
def _sparse24_linear_kernel(
    x_ptr, values_ptr, meta_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_vn, stride_mn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
        group = (offs_k // 4)[:, None]
        v_ptrs = values_ptr + n64 * stride_vn + 2 * group
        v0 = tl.load(v_ptrs, mask=w_mask, other=0.0)
        v1 = tl.load(v_ptrs + 1, mask=w_mask, other=0.0)
        byte = tl.load(meta_ptr + n64 * stride_mn + (offs_k // 8)[:, None], mask=w_mask, other=0).to(tl.int32)
        nibble = (byte >> ((group % 2) * 4)) & 0xF
        pos = (offs_k % 4)[:, None]
        w = tl.where(pos == (nibble & 3), v0, tl.where(pos == (nibble >> 2), v1, 0.0))
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, bias_ptr, partial_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
               HAS_BIAS, SPLIT_K)  # fmt: skip


def sparse24_linear_triton(x, values, meta, bias=None, config: dict | None = None):
    K = x.shape[-1]
    x2 = as_rows(x)
    M, N = x2.shape[0], values.shape[0]
    out = empty((M, N), x.dtype, x.device)
    if (done := nothing_to_multiply(out, x.shape, bias)) is not None:
        return done
    values, meta = contiguous_rows(values), contiguous_rows(meta)
    # The tuning-cache key (`kiln tune` stores under what this asks for). No `bias`: it is one [BLOCK_N]
    # load and add in the epilogue of a tile that streams K / 2 kept values per column, so it does not
    # move the best tiling, and one tuned config then serves layers with and without a bias.
    shape = {"M": M, "N": N, "K": K}
    wide = x.dtype == torch.float32
    # The expanded fp32-select tile lives in registers like int4_linear's: at most 32 deep along K.
    cfg = resolve_config(
        "sparse24_linear", x.dtype, shape, config, x.device, wide_operands=wide, max_block_k=32
    )
    partials = partials_buffer(cfg, M, N, x.device)
    _sparse24_linear_kernel[launch_grid(cfg, M, N)](
        x2, values, meta, bias if bias is not None else out, out, partials if partials is not None else out,
        M, N, K,
        x2.stride(0), x2.stride(1), values.stride(0), meta.stride(0), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **tile_options(cfg),
    )  # fmt: skip
    reduce_split_k(partials, out, bias)
    return out.reshape(*x.shape[:-1], N)


SPARSE24_LINEAR.register(
    Implementation("triton", sparse24_linear_triton, triton_available, configs=config_space,
                   description="2:4 weight expanded in registers from kept halves + 2-bit positions")
)  # fmt: skip
