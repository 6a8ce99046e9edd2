"""Triton backward of softmax(x / T) over the last dim, from the saved output y:
    grad_x = y * (grad_y - sum(grad_y * y)) / T

One program owns one row: a first pass over BLOCK_N column blocks sums grad_y * y, a second writes
grad_x (two reads of y and grad_y, no row-sized scratch), math in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows, contiguous_rows

MAX_BLOCK_N = 4096


@triton.jit
def _softmax_backward_kernel(
    y_ptr,
    grad_y_ptr,
    grad_x_ptr,
    y_row_stride,
    grad_y_row_stride,
    grad_x_row_stride,
    n_cols,
    inv_temperature,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * y_row_stride
    g_row = grad_y_ptr + row * grad_y_row_stride
    cols = tl.arange(0, BLOCK_N)
    dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = c < n_cols
        y = tl.load(y_row + c, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_row + c, mask=mask, other=0.0).to(tl.float32)
        dot += y * g
    row_dot = tl.sum(dot, axis=0)
    for start in range(0, n_cols, BLOCK_N):
        c = start + cols
        mask = c < n_cols
        y = tl.load(y_row + c, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_row + c, mask=mask, other=0.0).to(tl.float32)
        grad_x = y * (g - row_dot) * inv_temperature
        tl.store(grad_x_ptr + row * grad_x_row_stride + c, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)


def softmax_backward_triton(y: torch.Tensor, grad_y: torch.Tensor, temperature: float) -> torch.Tensor:
    """grad_x [..., N] (y's dtype) of y = softmax(x / temperature) from y and grad_y."""
    n_cols = y.shape[-1]
    y2, g2 = contiguous_rows(as_rows(y)), contiguous_rows(as_rows(grad_y))
    rows = y2.shape[0]
    grad_x = empty((rows, n_cols), y.dtype, y.device)
    if rows and n_cols:
        block_n = min(triton.next_power_of_2(n_cols), MAX_BLOCK_N)
        _softmax_backward_kernel[(rows,)](
            y2, g2, grad_x, y2.stride(0), g2.stride(0), grad_x.stride(0), n_cols, 1.0 / temperature,
            BLOCK_N=block_n,
            num_warps=min(max(block_n // 256, 1), 16),
        )  # fmt: skip
    return grad_x.view(y.shape)
