"""Triton GEMM on GGUF weights in planes (gguf_planar.py): the CUDA kernel of prepared_linear's
"gguf_planar_<qtype>" layouts, the engine's GGUF path on a GPU.

Tiled like int4_linear (../tiling.py: grouped order, split-K for small M). Per BLOCK_K step a program
loads its x tile [BLOCK_M, BLOCK_K] and, for its BLOCK_N weight rows, each row's BLOCK_K / 8 nibble
words (contiguous: whole sectors, each word once; Q8_0: BLOCK_K int8 values), the words of the high
bits (Q5_0 / Q5_K: one per 32 weights, Q6_K: one per 16), one scale (and min) per group and, for the
K-quants, the super-block's d (and dmin). Words are split into fields by a broadcast shift and a
reshape ([BLOCK_K / 8, 8, BLOCK_N] -> [BLOCK_K, BLOCK_N]), scales broadcast over their group the same
way; scale = d * sc, min = -(dmin * m) and w = (q - OFFSET) * scale + min in float32, as ggml
decodes, rounded to x's dtype for tl.dot.

K is a whole number of groups and BLOCK_K a multiple of 32 (a high-bits word): a K tile holds whole
words and whole groups, and a split ends on a group. For the K-quants BLOCK_K divides 256 too, so a
tile lies in one super-block: one d (and dmin) a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows, contiguous_rows
from kiln.ops.gemm.gguf_planar import HIGH_BITS
from kiln.ops.gemm.tiling import (
    launch_grid,
    nothing_to_multiply,
    partials_buffer,
    reduce_split_k,
    resolve_config,
    store_tile,
    tile_options,
    tile_program,
)
from kiln.quant.gguf_blocks import QK_K, QUANT_OFFSET, SUPER_VALUES, WITH_MINS, scale_group

# The heuristic's K tiles: up to 64 inputs (float32 x: 32), as int4_linear, whose [16, 64, 64] tile
# compiles for sm_90 at 64-72 registers; a deeper one spills the decoded [BLOCK_K, BLOCK_N] tile. By
# wide (float32) operands.
MAX_BLOCK_K = {False: 64, True: 32}


@triton.jit
def _per_group(values, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_K / GROUP, BLOCK_N] -> [BLOCK_K, BLOCK_N], each value repeated over its group."""
    grouped = tl.broadcast_to(values[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N))
    return tl.reshape(grouped, (BLOCK_K, BLOCK_N))


@triton.jit
def _bit_fields(words, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 words [BLOCK_K * WIDTH / 32, BLOCK_N] -> their WIDTH-bit fields [BLOCK_K, BLOCK_N], field
    i of word j at row j * 32 / WIDTH + i."""
    PER_WORD: tl.constexpr = 32 // WIDTH
    shifts = tl.arange(0, PER_WORD) * WIDTH
    fields = (words[:, None, :] >> shifts[None, :, None]) & ((1 << WIDTH) - 1)
    return tl.reshape(fields, (BLOCK_K, BLOCK_N))


@triton.jit
def _gguf_planar_kernel(
    x_ptr, qs_ptr, qh_ptr, scales_ptr, mins_ptr, supers_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_hn, stride_sn, stride_mn, stride_un, stride_om, stride_on,
    BYTE_VALUES: tl.constexpr, HIGH_BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr,
    HAS_MINS: tl.constexpr, SUPERS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, m_mask, n_mask, pid_k, k_start, k_end = tile_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K
    )
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    n64 = offs_n[None, :].to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):  # k0: a multiple of BLOCK_K, hence of 32
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if BYTE_VALUES:  # Q8_0: the signed values themselves, BLOCK_K contiguous bytes per row
            q = tl.load(
                qs_ptr + n64 * stride_qn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0
            ).to(tl.int32)
        else:
            offs_w = tl.max_contiguous(
                tl.multiple_of(k0 // 8 + tl.arange(0, BLOCK_K // 8), BLOCK_K // 8), BLOCK_K // 8
            )
            w_mask = (offs_w * 8 < k_end)[:, None] & n_mask[None, :]
            words = tl.load(qs_ptr + n64 * stride_qn + offs_w[:, None], mask=w_mask, other=0)
            q = _bit_fields(words, 4, BLOCK_K, BLOCK_N)
            if HIGH_BITS > 0:
                H: tl.constexpr = 32 // HIGH_BITS  # weights per high-bits word
                offs_h = k0 // H + tl.arange(0, BLOCK_K // H)
                h_mask = (offs_h * H < k_end)[:, None] & n_mask[None, :]
                high = tl.load(qh_ptr + n64 * stride_hn + offs_h[:, None], mask=h_mask, other=0)
                q = q | (_bit_fields(high, HIGH_BITS, BLOCK_K, BLOCK_N) << 4)
        groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        g_mask = (groups * GROUP < k_end)[:, None] & n_mask[None, :]
        scale = tl.load(scales_ptr + n64 * stride_sn + groups[:, None], mask=g_mask, other=0).to(tl.float32)
        if SUPERS > 0:  # K-quants: the tile lies in one super-block (BLOCK_K divides 256)
            super_row = supers_ptr + n64 * stride_un + k0 // 256 * SUPERS  # [1, BLOCK_N]: its d (, dmin)
            scale = tl.load(super_row, mask=n_mask[None, :], other=0.0).to(tl.float32) * scale
        w = (q - OFFSET).to(tl.float32) * _per_group(scale, GROUP, BLOCK_K, BLOCK_N)
        if HAS_MINS:  # groups of 32 (Q4_1, Q4_K, Q5_K)
            groups32 = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            m_mask32 = (groups32 * 32 < k_end)[:, None] & n_mask[None, :]
            mins = tl.load(mins_ptr + n64 * stride_mn + groups32[:, None], mask=m_mask32, other=0)
            mins = mins.to(tl.float32)
            if SUPERS > 1:  # Q4_K, Q5_K: min = -(dmin * m)
                mins = -(tl.load(super_row + 1, mask=n_mask[None, :], other=0.0).to(tl.float32) * mins)
            w = w + _per_group(mins, 32, BLOCK_K, BLOCK_N)
        # Past k_end x is 0 and w is 0 (masked scales): those lanes add nothing.
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, bias_ptr, partial_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
               HAS_BIAS, SPLIT_K)  # fmt: skip


def gguf_planar_linear_triton(x, planes, qtype: str, bias=None, config: dict | None = None):
    """x [..., K] float32 / float16 / bfloat16 @ W^T (+ bias [N] in x's dtype) -> [..., N] in x's dtype,
    W the [N, K] matrix the planes (qs, qh, scales, mins, supers) of gguf_planar.pack_planar stand for
    in `qtype`; accumulation in float32. K: a multiple of the qtype's block (32, or 256 for K-quants)."""
    qs, qh, scales, mins, supers = (contiguous_rows(t) for t in planes)
    K = x.shape[-1]
    x2 = contiguous_rows(as_rows(x))
    M, N = x2.shape[0], qs.shape[0]
    out = empty((M, N), x.dtype, x.device)
    if (done := nothing_to_multiply(out, x.shape, bias)) is not None:
        return done
    wide = x.dtype == torch.float32
    shape = {"M": M, "N": N, "K": K, "qtype": qtype}
    cfg = resolve_config("gguf_planar_linear", x.dtype, shape, config, x.device, min_block_k=32,
                         wide_operands=wide, max_block_k=MAX_BLOCK_K[wide])  # fmt: skip
    if qtype in SUPER_VALUES and cfg["BLOCK_K"] > QK_K:
        raise ValueError(f"gguf_planar_linear: BLOCK_K={cfg['BLOCK_K']} must divide {QK_K} for {qtype}")
    partials = partials_buffer(cfg, M, N, x.device)
    bits = HIGH_BITS.get(qtype, 0)
    _gguf_planar_kernel[launch_grid(cfg, M, N)](
        x2, qs, qh if bits else qs, scales, mins if qtype in WITH_MINS else scales,
        supers if qtype in SUPER_VALUES else scales,
        bias.contiguous() if bias is not None else out, out, partials if partials is not None else out,
        M, N, K,
        x2.stride(0), qs.stride(0), qh.stride(0), scales.stride(0), mins.stride(0), supers.stride(0),
        out.stride(0), out.stride(1),
        BYTE_VALUES=qtype == "Q8_0", HIGH_BITS=bits, GROUP=scale_group(qtype),
        OFFSET=QUANT_OFFSET.get(qtype, 0), HAS_MINS=qtype in WITH_MINS,
        SUPERS=SUPER_VALUES.get(qtype, 0), HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if wide else "tf32", **tile_options(cfg),
    )  # fmt: skip
    reduce_split_k(partials, out, bias)
    return out.reshape(*x.shape[:-1], N)
