"""Triton gguf_linear: GGUF weights (Q4_0 / Q4_1 / Q5_0 / Q8_0, K-quants Q4_K / Q5_K / Q6_K) read
straight from the file's uint8 blocks, decoded in registers by ../gguf_triton.py (never written to
memory as floats).

  * `_gguf_gemv_kernel` (decode, M <= GEMV_MAX_M): one x row and BLOCK_N outputs per program, split
    along K; Q4_0 / Q4_1 / Q8_0: per-block integer dot products, scaled once per block (no tl.dot, so
    no 16-row padding); Q5_0 and the K-quants: each weight decoded (`dequantize_at`), then the dot;
  * `_gguf_gemm_kernel` (prefill): the tiled/grouped/split-K GEMM of ../tiling.py with the weight
    tile dequantized in registers and rounded to x's dtype for tl.dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows, contiguous_rows
from kiln.ops.gemm.gguf_linear.spec import GGUF_LINEAR
from kiln.ops.gemm.gguf_triton import dequantize_at, fp16_at
from kiln.ops.gemm.tiling import (
    config_space,
    k_range,
    kernel_options,
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
from kiln.quant.gguf_blocks import BLOCK_BYTES

GEMV_MAX_M = 4


@triton.jit
def _gguf_gemv_kernel(
    x_ptr, qweight_ptr, bias_ptr, out_ptr, partial_ptr, M, N, K,
    stride_xm, stride_qn, stride_om, stride_on,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Decode GEMV over [BLOCK_N rows, BLOCK_K / 32 blocks, 32 weights] tiles: each block's scale is
    loaded once, the integer quants are dotted with x inside the block first and scaled after
    (sum_j d * q_j * x_j = d * sum_j q_j * x_j; Q4_1 adds m * sum_j x_j), as llama.cpp's vec_dot does."""
    NUM_BLOCKS: tl.constexpr = BLOCK_K // 32
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_start, k_end = k_range(pid_k, K, BLOCK_K, SPLIT_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = qweight_ptr + offs_n.to(tl.int64) * stride_qn
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        blocks = k0 // 32 + tl.arange(0, NUM_BLOCKS)
        b_mask = blocks * 32 < k_end  # K is a multiple of 32: whole 32-weight runs are in or out
        x = tl.load(
            x_ptr + row.to(tl.int64) * stride_xm + blocks[:, None] * 32 + j[None, :],
            mask=b_mask[:, None],
            other=0.0,
        ).to(tl.float32)  # [NUM_BLOCKS, 32]
        base = rows[:, None] + blocks[None, :] * BLOCK_BYTES  # [BLOCK_N, NUM_BLOCKS] (32-block types)
        mask = n_mask[:, None] & b_mask[None, :]
        if QTYPE == "Q5_0" or QTYPE == "Q4_K" or QTYPE == "Q5_K" or QTYPE == "Q6_K":
            # the decoded [BLOCK_N, NUM_BLOCKS, 32] tile (K-quants: 32 weights of a super-block each)
            k = (blocks[:, None] * 32 + j[None, :])[None, :, :]
            w = dequantize_at(rows[:, None, None], k, mask[:, :, None], QTYPE, BLOCK_BYTES)
            acc += tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)
        elif QTYPE == "Q8_0":
            q = tl.load(base[:, :, None] + 2 + j[None, None, :], mask=mask[:, :, None], other=0)
            block_dot = tl.sum(q.to(tl.int8, bitcast=True).to(tl.float32) * x[None, :, :], axis=2)
            acc += tl.sum(fp16_at(base, mask) * block_dot, axis=1)
        else:
            first = 4 if QTYPE == "Q4_1" else 2
            byte = tl.load(base[:, :, None] + first + (j % 16)[None, None, :], mask=mask[:, :, None], other=0)
            q = ((byte >> ((j // 16) * 4).to(tl.uint8)[None, None, :]) & 0xF).to(tl.float32)
            block_dot = tl.sum(q * x[None, :, :], axis=2)
            d = fp16_at(base, mask)
            if QTYPE == "Q4_0":
                acc += tl.sum(d * (block_dot - 8.0 * tl.sum(x, axis=1)[None, :]), axis=1)
            else:
                m = fp16_at(base + 2, mask)
                acc += tl.sum(d * block_dot + m * tl.sum(x, axis=1)[None, :], axis=1)
    m_idx = row + tl.arange(0, 1)
    store_tile(acc[None, :], out_ptr, bias_ptr, partial_ptr, m_idx, offs_n, M, N, stride_om, stride_on, pid_k,
               HAS_BIAS, SPLIT_K)  # fmt: skip


@triton.jit
def _gguf_gemm_kernel(
    x_ptr, qweight_ptr, bias_ptr, out_ptr, partial_ptr, M, N, K,
    stride_xm, stride_qn, stride_om, stride_on,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, m_mask, n_mask, pid_k, k_start, k_end = tile_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K
    )
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    cols = qweight_ptr + offs_n[None, :].to(tl.int64) * stride_qn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = dequantize_at(cols, offs_k[:, None], k_mask[:, None] & n_mask[None, :], QTYPE, BLOCK_BYTES)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, bias_ptr, partial_ptr, offs_m, offs_n, M, N, stride_om, stride_on, pid_k,
               HAS_BIAS, SPLIT_K)  # fmt: skip


def gguf_linear_triton(x, qweight, qtype, bias=None, config: dict | None = None):
    K = x.shape[-1]
    x2 = contiguous_rows(as_rows(x))
    M, N = x2.shape[0], qweight.shape[0]
    out = empty((M, N), x.dtype, x.device)
    if (done := nothing_to_multiply(out, x.shape, bias)) is not None:
        return done
    qweight = contiguous_rows(qweight)
    shape = {"M": M, "N": N, "K": K, "qtype": qtype}
    # The tiled GEMM keeps a dequantized [BLOCK_K, BLOCK_N] tile in registers: at BLOCK_K 128 (the
    # small-M default) Triton 3.6 spills it on sm_90 (424-616 bytes for Q4_1; python -m kiln.tune.aot).
    # The GEMV's per-weight decode of Q6_K / Q5_0 at BLOCK_K 128 holds a [64, 4, 32] tile of decoded
    # weights and their bit fields: 255 registers and 272 spill bytes for Q6_K on sm_90 (Q4_K: 96).
    heavy_decode = M <= GEMV_MAX_M and qtype in ("Q6_K", "Q5_0")
    cfg = resolve_config("gguf_linear", x.dtype, shape, config, x.device, min_block_k=32,
                         wide_operands=x.dtype == torch.float32,
                         max_block_k=64 if M > GEMV_MAX_M or heavy_decode else None)  # fmt: skip
    bias_arg = bias.contiguous() if bias is not None else out
    common = dict(QTYPE=qtype, BLOCK_BYTES=BLOCK_BYTES[qtype], HAS_BIAS=bias is not None)
    if M <= GEMV_MAX_M:
        split_k = cfg["SPLIT_K"]
        partials = partials_buffer(cfg, M, N, x.device)
        _gguf_gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), M, split_k)](
            x2, qweight, bias_arg, out, partials if partials is not None else out, M, N, K,
            x2.stride(0), qweight.stride(0), out.stride(0), out.stride(1),
            BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split_k, **common, **kernel_options(cfg),
        )  # fmt: skip
    else:
        partials = partials_buffer(cfg, M, N, x.device)
        _gguf_gemm_kernel[launch_grid(cfg, M, N)](
            x2, qweight, bias_arg, out, partials if partials is not None else out, M, N, K,
            x2.stride(0), qweight.stride(0), out.stride(0), out.stride(1),
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common, **tile_options(cfg),
        )  # fmt: skip
    reduce_split_k(partials, out, bias)
    return out.reshape(*x.shape[:-1], N)


def _gguf_configs(shape, dtype):
    return config_space(shape, dtype, min_block_k=32)


GGUF_LINEAR.register(
    Implementation("triton", gguf_linear_triton, triton_available, configs=_gguf_configs,
                   description="raw GGUF blocks dequantized in registers; GEMV for M <= 4, tiled GEMM above")
)  # fmt: skip
