"""Triton softmax kernel. One program owns one row.

Short rows (N <= MAX_BLOCK_N) are loaded once into registers: max, exp, sum, divide, store.
Long rows (a 128k vocabulary) use the online softmax: a first pass over column blocks keeps, per
lane, a running max m and a running sum d of exp(x - m), rescaling d by exp(m_old - m_new) whenever
the max grows; the lanes are then merged into the row's (M, D), and a second pass writes
exp(x - M) / D. Two reads of the row instead of three, and no row-sized scratch buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.alloc import empty_like
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.softmax.spec import SOFTMAX

MAX_BLOCK_N = 8192
LOOP_BLOCK_N = 4096


@triton.jit
def _softmax_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    n_cols,
    inv_temperature,
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(out_row + cols, (e / tl.sum(e, axis=0)).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
        d = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            x = tl.load(x_row + c, mask=c < n_cols, other=float("-inf")).to(tl.float32) * inv_temperature
            m_new = tl.maximum(m, x)
            # A lane that has seen only -inf so far keeps m = -inf; exp(-inf - -inf) would be NaN,
            # so shift by 0 there (its d is 0 and exp(x - 0) = exp(-inf) = 0).
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            d = d * tl.exp(m - shift) + tl.exp(x - shift)
            m = m_new
        row_max = tl.max(m, axis=0)
        row_sum = tl.sum(d * tl.exp(m - row_max), axis=0)
        inv_sum = 1.0 / row_sum
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
            tl.store(out_row + c, (tl.exp(x - row_max) * inv_sum).to(out_ptr.dtype.element_ty), mask=mask)


def softmax_triton(x, temperature=1.0):
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = empty_like(x2)
    n_rows = x2.shape[0]
    if n_rows == 0 or n_cols == 0:
        return out.view(x.shape)
    single = n_cols <= MAX_BLOCK_N
    block_n = triton.next_power_of_2(n_cols) if single else LOOP_BLOCK_N
    _softmax_kernel[(n_rows,)](
        x2,
        out,
        x2.stride(0),
        out.stride(0),
        n_cols,
        1.0 / temperature,
        BLOCK_N=block_n,
        SINGLE_BLOCK=single,
        num_warps=min(max(block_n // 256, 1), 16),
    )
    return out.view(x.shape)


SOFTMAX.register(Implementation("triton", softmax_triton, triton_available))
