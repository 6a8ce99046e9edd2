"""Triton gguf_dequantize: one [BLOCK_N, BLOCK_K] tile of W per program, decoded from the raw GGUF
blocks by ../gguf_triton.py's `dequantize_at` in float32 without FMA contraction (so float32 output is
bit-exact with `gguf.quants.dequantize`). Other GGML types decode on the host (../gguf_blocks.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import contiguous_rows
from kiln.ops.gemm.gguf_blocks import QTYPES, dequantize_on_host
from kiln.ops.gemm.gguf_dequantize.spec import GGUF_DEQUANTIZE
from kiln.ops.gemm.gguf_triton import dequantize_at
from kiln.ops.registry import Implementation, triton_available
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS


@triton.jit
def _dequantize_kernel(
    qweight_ptr, out_ptr, N, K, stride_qn, stride_on,
    QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    rows = qweight_ptr + offs_n[:, None].to(tl.int64) * stride_qn
    w = dequantize_at(rows, offs_k[None, :], mask, QTYPE, BLOCK_BYTES)
    out = out_ptr + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def gguf_dequantize_triton(qweight, qtype, dtype=torch.float32):
    if qtype not in QTYPES:
        return dequantize_on_host(qweight, qtype, dtype)
    N = qweight.shape[0]
    K = qweight.shape[1] // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
    out = empty((N, K), dtype, qweight.device)
    if N == 0 or K == 0:
        return out
    qweight = contiguous_rows(qweight)
    block_n, block_k = 32, 128
    _dequantize_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k))](
        qweight, out, N, K, qweight.stride(0), out.stride(0),
        QTYPE=qtype, BLOCK_BYTES=BLOCK_BYTES[qtype], BLOCK_N=block_n, BLOCK_K=block_k,
        enable_fp_fusion=False,  # d * q + m exactly as ggml rounds it (no FMA): bit-exact float32
    )  # fmt: skip
    return out


GGUF_DEQUANTIZE.register(Implementation("triton", gguf_dequantize_triton, triton_available))
