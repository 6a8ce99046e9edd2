"""Triton LayerNorm. One program owns one row; the variance is taken around the mean in a second
pass (never as E[x^2] - E[x]^2, which cancels catastrophically for rows with a large mean)."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.alloc import empty_like
from kiln.ops.checks import check_block_config
from kiln.ops.norm.common import MAX_BLOCK_N, rows
from kiln.ops.norm.layer_norm.spec import LAYER_NORM
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.tuned_configs import lookup


@triton.jit
def _layer_norm_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    n_cols,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_BLOCK:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        centered = tl.where(mask, x - mean, 0.0)  # padding lanes must not add (0 - mean)^2
        inv_std = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
        y = centered * inv_std * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Three passes over the row (mean, variance around the mean, normalize): the extra read
        # only happens for rows wider than MAX_BLOCK_N, and keeps the variance free of cancellation.
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            acc += tl.load(x_row + c, mask=c < n_cols, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / n_cols
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            centered = tl.where(mask, x - mean, 0.0)
            acc += centered * centered
        inv_std = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * inv_std * tl.load(weight_ptr + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm_configs(shape, dtype):
    """Tuning space: BLOCK_N (>= hidden: one block per row, else the looped path) x num_warps."""
    hidden = shape["hidden"]
    blocks = {b for b in (1024, 2048, 4096) if b < hidden}
    if hidden <= MAX_BLOCK_N:
        blocks.add(triton.next_power_of_2(hidden))
    return [
        {"BLOCK_N": block_n, "num_warps": warps}
        for block_n in sorted(blocks)
        for warps in (1, 2, 4, 8, 16)
        if block_n >= 32 * warps or warps == 1
    ]


def layer_norm_triton(x, weight, bias=None, eps=1e-5, config: dict | None = None):
    hidden = x.shape[-1]
    x2 = rows(x)
    out = empty_like(x2)
    n_rows = x2.shape[0]
    if n_rows == 0 or hidden == 0:
        return out.view(x.shape)
    if config is None:
        shape = {"rows": n_rows, "hidden": hidden, "bias": bias is not None}
        config = lookup("layer_norm", x.dtype, shape, x.device)
    if config is None:
        block_n = min(triton.next_power_of_2(hidden), MAX_BLOCK_N)
        config = {"BLOCK_N": block_n, "num_warps": min(max(block_n // 256, 1), 16)}
    check_block_config("layer_norm", config, ("BLOCK_N",))
    weight = weight.contiguous()
    _layer_norm_kernel[(n_rows,)](
        x2,
        weight,
        bias.contiguous() if bias is not None else weight,
        out,
        x2.stride(0),
        out.stride(0),
        hidden,
        eps,
        HAS_BIAS=bias is not None,
        BLOCK_N=config["BLOCK_N"],
        SINGLE_BLOCK=hidden <= config["BLOCK_N"],
        num_warps=config["num_warps"],
    )
    return out.view(x.shape)


LAYER_NORM.register(Implementation("triton", layer_norm_triton, triton_available, configs=layer_norm_configs))
