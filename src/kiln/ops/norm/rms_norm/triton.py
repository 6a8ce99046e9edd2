"""Triton RMSNorm. One program owns one row: it loads the row (and the residual), writes the sum back
as the new residual, reduces the sum of squares in float32 and writes the normalized row. Rows
longer than BLOCK_N are handled by looping over column blocks. The weight is scaled as
(weight_offset + weight) in float32 (Gemma's norm: offset 1)."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.alloc import empty_like
from kiln.ops.checks import as_rows
from kiln.ops.norm.common import MAX_BLOCK_N, rows
from kiln.ops.norm.rms_norm.spec import RMS_NORM
from kiln.ops.registry import Implementation, triton_available


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    n_cols,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    res_row = residual_ptr + row * residual_row_stride
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_row + cols, x.to(residual_ptr.dtype.element_ty), mask=mask)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
        tl.store(out_row + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Two passes over the row: the first stores the residual sum and accumulates squares,
        # the second re-reads (the stored sum when fused, so both passes see the same values).
        sum_sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(res_row + c, mask=mask, other=0.0).to(tl.float32)
                tl.store(res_row + c, x.to(residual_ptr.dtype.element_ty), mask=mask)
            sum_sq += x * x
        inv_rms = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            if HAS_RESIDUAL:
                x = tl.load(res_row + c, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32) + weight_offset
            tl.store(out_row + c, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x, weight, eps=1e-6, residual=None, weight_offset=0.0):
    hidden = x.shape[-1]
    x2 = rows(x)
    res2 = None
    if residual is not None:
        res2 = as_rows(residual) if residual.is_contiguous() else None
        if res2 is None:
            raise ValueError("rms_norm: residual must be contiguous (it is updated in place)")
    out = empty_like(x2)
    n_rows = x2.shape[0]
    if n_rows == 0 or hidden == 0:
        return out.view(x.shape) if residual is None else (out.view(x.shape), residual)
    block_n = min(triton.next_power_of_2(hidden), MAX_BLOCK_N)
    _rms_norm_kernel[(n_rows,)](
        x2,
        res2 if res2 is not None else x2,
        weight.contiguous(),
        out,
        x2.stride(0),
        res2.stride(0) if res2 is not None else 0,
        out.stride(0),
        hidden,
        eps,
        float(weight_offset),
        HAS_RESIDUAL=res2 is not None,
        BLOCK_N=block_n,
        SINGLE_BLOCK=hidden <= block_n,
        num_warps=min(max(block_n // 256, 1), 16),
    )
    out = out.view(x.shape)
    return out if residual is None else (out, residual)


RMS_NORM.register(Implementation("triton", rms_norm_triton, triton_available))
