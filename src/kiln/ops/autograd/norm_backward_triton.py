"""Triton backward kernels of RMSNorm and LayerNorm over the last dim.

RMSNorm, y = x r w' with r = 1 / sqrt(mean(x^2) + eps), w' = weight + weight_offset:
    grad_x = r (g w' - x r^2 mean(g w' x)),  grad_weight = sum_rows g x r
LayerNorm, xhat = (x - mean(x)) r with r = 1 / sqrt(var(x) + eps), y = xhat w + b:
    grad_x = r (g w - mean(g w) - xhat mean(g w xhat)),  grad_weight = sum_rows g xhat,
    grad_bias = sum_rows g
The statistics are recomputed from x (one extra row reduction instead of saving them forward).

Grid (programs,): each program owns a contiguous run of rows, one whole row (BLOCK_N >= hidden) at a
time, writes grad_x for its rows and accumulates its rows' share of grad_weight (and grad_bias) in
float32 registers; it stores that partial sum as row `pid` of a [programs, hidden] buffer, summed on
the host afterwards. No atomics: the result does not depend on scheduling (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows, contiguous_rows

# One row in registers; wider rows would need a looped kernel (no LLM norm is this wide).
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_backward_kernel(
    x_ptr,
    weight_ptr,
    grad_y_ptr,
    grad_sum_ptr,
    grad_x_ptr,
    partial_dw_ptr,
    x_row_stride,
    grad_y_row_stride,
    grad_sum_row_stride,
    grad_x_row_stride,
    rows,
    hidden,
    rows_per_program,
    eps,
    weight_offset,
    HAS_GRAD_SUM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program  # int64 row offsets: rows * stride may pass 2^31
    last = tl.minimum(first + rows_per_program, rows)
    for row in range(first, last):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_y_ptr + row * grad_y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
        gw = g * w
        dx = inv_rms * (gw - x * (inv_rms * inv_rms * tl.sum(gw * x, axis=0) / hidden))
        if HAS_GRAD_SUM:  # the fused-residual variant: the sum's own gradient joins the norm's
            dx += tl.load(grad_sum_ptr + row * grad_sum_row_stride + cols, mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(grad_x_ptr + row * grad_x_row_stride + cols, dx.to(grad_x_ptr.dtype.element_ty), mask=mask)
        dw += g * x * inv_rms
    tl.store(partial_dw_ptr + pid * hidden + cols, dw, mask=mask)


@triton.jit
def _layer_norm_backward_kernel(
    x_ptr,
    weight_ptr,
    grad_y_ptr,
    grad_x_ptr,
    partial_dw_ptr,
    partial_db_ptr,
    x_row_stride,
    grad_y_row_stride,
    grad_x_row_stride,
    rows,
    hidden,
    rows_per_program,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program  # int64 row offsets: rows * stride may pass 2^31
    last = tl.minimum(first + rows_per_program, rows)
    for row in range(first, last):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_y_ptr + row * grad_y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / hidden
        centered = tl.where(mask, x - mean, 0.0)  # two-pass variance: no E[x^2] - E[x]^2 cancellation
        inv_std = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / hidden + eps)
        xhat = centered * inv_std
        gw = g * w
        dx = inv_std * (gw - tl.sum(gw, axis=0) / hidden - xhat * (tl.sum(gw * xhat, axis=0) / hidden))
        tl.store(grad_x_ptr + row * grad_x_row_stride + cols, dx.to(grad_x_ptr.dtype.element_ty), mask=mask)
        dw += g * xhat
        if HAS_BIAS:
            db += g
    tl.store(partial_dw_ptr + pid * hidden + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(partial_db_ptr + pid * hidden + cols, db, mask=mask)


def _programs(rows: int, device: torch.device) -> int:
    """Enough programs to fill the GPU (a few per SM); fewer partial-sum rows on the interpreter."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4
    return max(1, min(rows, target))


def _block(op: str, hidden: int) -> int:
    if hidden > MAX_HIDDEN:
        raise ValueError(f"{op} backward: hidden size {hidden} is wider than the kernel's {MAX_HIDDEN}")
    return triton.next_power_of_2(max(hidden, 1))


def rms_norm_backward_triton(x, weight, grad_y, eps, weight_offset=0.0, grad_sum=None):
    """(grad_x [..., hidden] x's dtype, grad_weight [hidden] weight's dtype) for y = rms_norm(x);
    with grad_sum (the fused-residual variant's gradient of the sum) it is added to grad_x."""
    hidden = x.shape[-1]
    x2, g2 = contiguous_rows(as_rows(x)), contiguous_rows(as_rows(grad_y))
    gs2 = contiguous_rows(as_rows(grad_sum)) if grad_sum is not None else g2
    rows = x2.shape[0]
    grad_x = empty((rows, hidden), x.dtype, x.device)
    if rows == 0 or hidden == 0:
        return grad_x.view(x.shape), torch.zeros_like(weight)
    block_n = _block("rms_norm", hidden)
    programs = _programs(rows, x.device)
    partial_dw = empty((programs, hidden), torch.float32, x.device)
    _rms_norm_backward_kernel[(programs,)](
        x2, weight, g2, gs2, grad_x, partial_dw,
        x2.stride(0), g2.stride(0), gs2.stride(0), grad_x.stride(0),
        rows, hidden, triton.cdiv(rows, programs), float(eps), float(weight_offset),
        HAS_GRAD_SUM=grad_sum is not None,
        BLOCK_N=block_n,
        num_warps=min(max(block_n // 256, 1), 16),
    )  # fmt: skip
    return grad_x.view(x.shape), partial_dw.sum(dim=0).to(weight.dtype)


def layer_norm_backward_triton(x, weight, bias, grad_y, eps):
    """(grad_x, grad_weight, grad_bias or None) for y = layer_norm(x, weight, bias, eps)."""
    hidden = x.shape[-1]
    x2, g2 = contiguous_rows(as_rows(x)), contiguous_rows(as_rows(grad_y))
    rows = x2.shape[0]
    grad_x = empty((rows, hidden), x.dtype, x.device)
    has_bias = bias is not None
    if rows == 0 or hidden == 0:
        return grad_x.view(x.shape), torch.zeros_like(weight), torch.zeros_like(bias) if has_bias else None
    block_n = _block("layer_norm", hidden)
    programs = _programs(rows, x.device)
    partial_dw = empty((programs, hidden), torch.float32, x.device)
    partial_db = empty((programs, hidden), torch.float32, x.device) if has_bias else partial_dw
    _layer_norm_backward_kernel[(programs,)](
        x2, weight, g2, grad_x, partial_dw, partial_db,
        x2.stride(0), g2.stride(0), grad_x.stride(0),
        rows, hidden, triton.cdiv(rows, programs), float(eps),
        HAS_BIAS=has_bias,
        BLOCK_N=block_n,
        num_warps=min(max(block_n // 256, 1), 16),
    )  # fmt: skip
    grad_bias = partial_db.sum(dim=0).to(bias.dtype) if has_bias else None
    return grad_x.view(x.shape), partial_dw.sum(dim=0).to(weight.dtype), grad_bias
