"""The one Triton kernel of the gated activations (launched by silu_and_mul/triton.py and
gelu_tanh_and_mul/triton.py with ACTIVATION "silu" or "gelu_tanh").

Grid (rows, cdiv(d, BLOCK_D)): each program owns BLOCK_D output columns of one row, loads the
matching gate and up columns (d apart in the same row), and writes act(gate) * up computed in float32.

Both activations go through sigmoid, which saturates cleanly at both ends in float32
(1 / (1 + exp(-u)) -> 0 or 1, never NaN): silu(a) = a * sigmoid(a), and the tanh form of GELU is
exactly 0.5 * a * (1 + tanh(z)) = a * sigmoid(2z), so no tanh intrinsic is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.checks import as_rows, check_block_config
from kiln.ops.tuned_configs import lookup

MAX_BLOCK_D = 1024
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a plain float global is rejected by the compiler


@triton.jit
def _gated_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
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
    if ACTIVATION == "silu":
        u = gate
    else:  # "gelu_tanh"
        u = 2.0 * SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    act = gate / (1.0 + tl.exp(-u))
    tl.store(out_ptr + row * out_row_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def gated_configs(shape, dtype):
    """Tuning space: output columns per program x num_warps."""
    top = max(triton.next_power_of_2(shape["d"]), 128)
    return [
        {"BLOCK_D": block_d, "num_warps": warps}
        for block_d in (128, 256, 512, 1024, 2048, 4096)
        if block_d <= top
        for warps in (1, 2, 4, 8)
        if block_d >= 32 * warps  # at least one element per thread
    ]


def _heuristic(d: int) -> dict:
    block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
    return {"BLOCK_D": block_d, "num_warps": max(min(block_d // 128, 8), 1)}


def launch_gated(x, activation: str, op: str, config: dict | None):
    """act(x[..., :d]) * x[..., d:] for x [..., 2*d] with ACTIVATION = `activation` ("silu" or
    "gelu_tanh"); `op` names the tuned configs to look up and the errors."""
    d = x.shape[-1] // 2
    x2 = as_rows(x)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = empty((rows, d), x.dtype, x.device)
    if rows and d:
        if config is None:
            config = lookup(op, x.dtype, {"rows": rows, "d": d}, x.device) or _heuristic(d)
        check_block_config(op, config, ("BLOCK_D",))
        grid = (rows, triton.cdiv(d, config["BLOCK_D"]))
        _gated_kernel[grid](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            d,
            ACTIVATION=activation,
            BLOCK_D=config["BLOCK_D"],
            num_warps=config["num_warps"],
        )
    return out.view(*x.shape[:-1], d)
