"""Triton backward of the gated activations (silu_and_mul, gelu_tanh_and_mul).

    x = [gate | up] [rows, 2d], grad_y [rows, d] -> grad_x [rows, 2d]:
    grad_gate = grad_y * up * act'(gate),  grad_up = grad_y * act(gate)
Both activations are a * sigmoid(u(a)) (silu: u = a; tanh-GELU: u = 2 sqrt(2/pi) (a + 0.044715 a^3),
the same identity the forward kernel uses), so act'(a) = s + a s (1 - s) u'(a) with s = sigmoid(u).

Grid (rows, cdiv(d, BLOCK_D)): a program owns BLOCK_D columns of one row, reads the gate, up and
grad_y columns, writes both halves of grad_x; math in float32, one rounding of each output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows, contiguous_rows

MAX_BLOCK_D = 1024
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _gated_backward_kernel(
    x_ptr,
    grad_y_ptr,
    grad_x_ptr,
    x_row_stride,
    grad_y_row_stride,
    grad_x_row_stride,
    d,
    ACTIVATION: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + row * grad_y_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        u = gate
        du = tl.full((BLOCK_D,), 1.0, tl.float32)
    else:  # "gelu_tanh"
        u = 2.0 * SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        du = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * gate * gate)
    s = 1.0 / (1.0 + tl.exp(-u))
    act = gate * s
    act_grad = s + gate * s * (1.0 - s) * du
    grad_x_row = grad_x_ptr + row * grad_x_row_stride
    out_dtype = grad_x_ptr.dtype.element_ty
    tl.store(grad_x_row + cols, (grad_y * up * act_grad).to(out_dtype), mask=mask)
    tl.store(grad_x_row + d + cols, (grad_y * act).to(out_dtype), mask=mask)


def gated_backward_triton(x: torch.Tensor, grad_y: torch.Tensor, activation: str) -> torch.Tensor:
    """grad_x [..., 2d] (x's dtype) for y = act(x[..., :d]) * x[..., d:]; activation "silu" | "gelu_tanh"."""
    d = x.shape[-1] // 2
    x2 = contiguous_rows(as_rows(x))
    g2 = contiguous_rows(as_rows(grad_y))
    rows = x2.shape[0]
    grad_x = empty((rows, 2 * d), x.dtype, x.device)
    if rows and d:
        block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
        _gated_backward_kernel[(rows, triton.cdiv(d, block_d))](
            x2,
            g2,
            grad_x,
            x2.stride(0),
            g2.stride(0),
            grad_x.stride(0),
            d,
            ACTIVATION=activation,
            BLOCK_D=block_d,
            num_warps=max(min(block_d // 128, 8), 1),
        )
    return grad_x.view(x.shape)
