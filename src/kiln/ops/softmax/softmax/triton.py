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
from kiln.ops.checks import as_rows, check_block_config
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.softmax.softmax.spec import SOFTMAX
from kiln.ops.tuned_configs import lookup

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


def softmax_configs(shape, dtype):
    """Tuning space: BLOCK_N (>= cols means one block per row, else the looped online path) x num_warps."""
    cols = shape["cols"]
    blocks = {b for b in (1024, 2048, 4096, 8192) if b < cols}
    if cols <= 2 * MAX_BLOCK_N:
        blocks.add(triton.next_power_of_2(cols))
    return [
        {"BLOCK_N": block_n, "num_warps": warps}
        for block_n in sorted(blocks)
        for warps in (2, 4, 8, 16)
        if block_n >= 32 * warps or warps == 2  # at least one element per thread
    ]


def _heuristic(cols: int) -> dict:
    block_n = triton.next_power_of_2(cols) if cols <= MAX_BLOCK_N else LOOP_BLOCK_N
    return {"BLOCK_N": block_n, "num_warps": min(max(block_n // 256, 1), 16)}


def _resolve_config(config, dtype, rows, cols, device):
    if config is None:
        config = lookup("softmax", dtype, {"rows": rows, "cols": cols}, device) or _heuristic(cols)
    return check_block_config("softmax", config, ("BLOCK_N",))


def softmax_triton(x, temperature=1.0, config: dict | None = None):
    n_cols = x.shape[-1]
    x2 = as_rows(x)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = empty_like(x2)
    n_rows = x2.shape[0]
    if n_rows == 0 or n_cols == 0:
        return out.view(x.shape)
    config = _resolve_config(config, x.dtype, n_rows, n_cols, x.device)
    _softmax_kernel[(n_rows,)](
        x2,
        out,
        x2.stride(0),
        out.stride(0),
        n_cols,
        1.0 / temperature,
        BLOCK_N=config["BLOCK_N"],
        SINGLE_BLOCK=n_cols <= config["BLOCK_N"],
        num_warps=config["num_warps"],
    )
    return out.view(x.shape)


SOFTMAX.register(Implementation("triton", softmax_triton, triton_available, configs=softmax_configs))
