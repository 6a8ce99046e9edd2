"""FP8 (e4m3fn) activation quantization and the FP8 GEMM.

quantize_fp8(x, per_token=True)
    x: [M, K] float32 / float16 / bfloat16
    -> (x_fp8 [M, K] float8_e4m3fn, scale float32 [M, 1] (per token) or [1] (per tensor))
    scale = max(amax, 1e-12) / 448 over the row (or the whole tensor); x_fp8 = round(x / scale),
    round-to-nearest-even onto the e4m3 grid, so x ~= x_fp8 * scale.

fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16)
    x_fp8 [M, K] e4m3, x_scale float32 [M, 1] or [1]; w_fp8 [N, K] e4m3, w_scale float32 [N, 1] or [1];
    bias [N] in out_dtype or None.
    y = (x_fp8 * x_scale) @ (w_fp8 * w_scale)^T + bias, [M, N] in out_dtype; float32 accumulation.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor
from kiln.ops.gemm.shapes import (
    GEMM_TOLERANCE,
    fuzz_quantize_shapes,
    fuzz_scaled_gemm_shapes,
    gemm_flops,
    llm_shapes,
    quantize_bytes,
    quantize_flops,
    scaled_gemm_bytes,
)
from kiln.ops.registry import OpSpec, register_op
from kiln.ops.testing import compute_dtype, randn, uniform

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny positive scale instead of a division by zero


def quantize_fp8_reference(x, per_token=True):
    xf = x.to(compute_dtype(x.dtype))
    amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax().reshape(1)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """Exact product of the dequantized inputs (float64 under the verifier; out_dtype only says
    what the kernels round to)."""
    dtype = x_scale.dtype
    x = x_fp8.to(dtype) * x_scale.reshape(-1, 1)
    w = w_fp8.to(dtype) * w_scale.reshape(-1, 1)
    out = x @ w.T
    return out if bias is None else out + bias.to(dtype)


def _check_scale(op: str, name: str, scale, rows: int, device) -> None:
    check_tensor(op, name, scale, dtypes=(torch.float32, torch.float64), device=device)
    if tuple(scale.shape) not in ((rows, 1), (1,)):
        raise ValueError(f"{op}: {name} has shape {tuple(scale.shape)}, expected ({rows}, 1) or (1,)")


def validate_scaled_linear(op, qdtype, x_q, x_scale, w_q, w_scale, bias, out_dtype) -> None:
    """Shared checks of fp8_linear and int8_linear (quantized operands of dtype `qdtype`)."""
    check_tensor(op, "x", x_q, ndim=2, dtypes=(qdtype,))
    check_tensor(op, "weight", w_q, ndim=2, dtypes=(qdtype,), device=x_q.device)
    if w_q.shape[1] != x_q.shape[1]:
        raise ValueError(f"{op}: weight has {w_q.shape[1]} in-features, expected x's K = {x_q.shape[1]}")
    _check_scale(op, "x_scale", x_scale, x_q.shape[0], x_q.device)
    _check_scale(op, "w_scale", w_scale, w_q.shape[0], x_q.device)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: out_dtype {out_dtype} unsupported, expected float32, float16 or bfloat16")
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, device=x_q.device)
        if bias.shape[0] != w_q.shape[0]:
            raise ValueError(f"{op}: bias has {bias.shape[0]} elements, expected out-features {w_q.shape[0]}")


def _make_quantize_inputs(shape, dtype, device, generator):
    return {
        "x": randn((shape["M"], shape["K"]), dtype, device, generator, scale=3.0),
        "per_token": shape["per_token"],
    }


def make_scaled_linear_inputs(shape, dtype, device, generator, suffix: str, make_q) -> dict:
    """Inputs of fp8_linear / int8_linear: x_<suffix> [M, K] and w_<suffix> [N, K] from
    `make_q(size)`, per-token/per-channel (or per-tensor) float32 scales, optional bias, out_dtype.
    Drawn in argument order, so each op's generator stream is its own."""
    M, N, K = shape["M"], shape["N"], shape["K"]
    per = shape["per_token"]
    return {
        f"x_{suffix}": make_q((M, K)),
        "x_scale": uniform((M, 1) if per else (1,), 0.01, 0.05, torch.float32, device, generator),
        f"w_{suffix}": make_q((N, K)),
        "w_scale": uniform((N, 1) if per else (1,), 0.01, 0.05, torch.float32, device, generator) * K**-0.5,
        "bias": randn((N,), dtype, device, generator) if shape.get("bias") else None,
        "out_dtype": dtype,
    }


def _make_fp8_linear_inputs(shape, dtype, device, generator):
    def make_q(size):
        return (
            randn(size, torch.float32, device, generator, scale=40.0).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        )

    return make_scaled_linear_inputs(shape, dtype, device, generator, "fp8", make_q)


def _quantize_fuzz(rng):
    return [{**s, "per_token": per} for s in fuzz_quantize_shapes(rng) for per in (True, False)]


def _scaled_mm(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """cuBLASLt FP8 GEMM through torch (per-tensor or row-wise scales)."""
    xs = x_scale if x_scale.dim() == 2 else x_scale.reshape(())
    ws = w_scale.reshape(1, -1) if w_scale.dim() == 2 else w_scale.reshape(())
    return torch._scaled_mm(x_fp8, w_fp8.T, scale_a=xs, scale_b=ws, bias=bias, out_dtype=out_dtype)


QUANTIZE_FP8 = register_op(
    OpSpec(
        name="quantize_fp8",
        description="fused amax + scale + cast to float8_e4m3fn, per token or per tensor",
        reference=quantize_fp8_reference,
        make_inputs=_make_quantize_inputs,
        fuzz_shapes=_quantize_fuzz,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # The fp8 values are rounded from x / scale computed in float32 vs float64: they agree except
        # where the quotient lies within ~1e-7 of a rounding midpoint (one e4m3 step, 2^-3 relative,
        # in a rare element); the scale itself is one float32 rounding.
        tolerance={torch.float32: 1e-2, torch.float16: 1e-2, torch.bfloat16: 1e-2},
        flops=quantize_flops,
        bytes=quantize_bytes,
        outputs=lambda result, inputs: result,
        bench_shapes={
            "llm": [
                {"M": m, "K": k, "per_token": True} for k in (4096, 14336, 576) for m in (1, 64, 2048, 8192)
            ]
        },
    )
)

FP8_LINEAR = register_op(
    OpSpec(
        name="fp8_linear",
        description="(x_fp8 * x_scale) @ (w_fp8 * w_scale)^T (+ bias), per-tensor or per-token x per-channel",
        reference=fp8_linear_reference,
        make_inputs=_make_fp8_linear_inputs,
        fuzz_shapes=fuzz_scaled_gemm_shapes,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),  # out_dtype
        # Reference uses the same (quantized) inputs: only fp32 accumulation and the output rounding remain.
        tolerance=GEMM_TOLERANCE,
        flops=gemm_flops,
        bytes=scaled_gemm_bytes,
        bench_shapes={"llm": llm_shapes(per_token=True)},
        baselines={"torch_scaled_mm": _scaled_mm},
    )
)


def quantize_fp8(x: torch.Tensor, per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` float -> (x_fp8 `[M, K]` e4m3fn, scale float32 `[M, 1]` if per_token else `[1]`)."""
    check_tensor("quantize_fp8", "x", x, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    return QUANTIZE_FP8(x, per_token)


def fp8_linear(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(x_fp8 * x_scale) @ (w_fp8 * w_scale)^T + bias -> `[M, N]` out_dtype (see module docstring)."""
    validate_scaled_linear("fp8_linear", FP8_DTYPE, x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    return FP8_LINEAR(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
