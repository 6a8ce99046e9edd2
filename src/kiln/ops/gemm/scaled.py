"""What the W8A8 ops share (quantize_fp8 / fp8_linear, quantize_int8 / int8_linear): the quantized
formats' constants, the scaled GEMM's argument contract and input maker, and its CPU math.

Both GEMMs take (x_q [M, K], x_scale float32 [M, 1] or [1], w_q [N, K], w_scale float32 [N, 1] or [1],
bias [N] or None, out_dtype) and compute (x_q * x_scale) @ (w_q * w_scale)^T + bias in out_dtype.
"""

from __future__ import annotations

import math

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of, dtype_name
from kiln.ops.testing import randn, uniform

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny positive scale instead of a division by zero
# The quantizers' exact check (quantize_int8 / quantize_fp8 verified_outputs): a correct float32 kernel's
# scale is amax / qmax rounded once (or twice, amax * (1 / qmax)): ~1e-7 relative; its x / scale errs by
# a few float32 roundings (a Mosaic kernel's division on a TPU; XLA and the GPU kernels divide rounded
# once, kiln.ops.jax_div_rn), so a code can differ from the exact quantization of x only where the exact
# quotient lies that close to a rounding tie.
SCALE_RTOL = 1e-6
TIE_RTOL = 1e-6


def snapped_scale(scale: torch.Tensor, exact_scale: torch.Tensor) -> torch.Tensor:
    """A quantizer's scale as its exact check sees it: `exact_scale` (float64, on the CPU) where `scale`
    lies within SCALE_RTOL of it, else the scale as given; in scale's dtype and on its device."""
    got = scale.detach().to(device="cpu", dtype=torch.float64)
    snapped = torch.where((got - exact_scale).abs() <= SCALE_RTOL * exact_scale, exact_scale, got)
    return snapped.to(device=scale.device, dtype=scale.dtype)


def _check_scale(op: str, name: str, scale, rows: int, device) -> None:
    check_tensor(op, name, scale, dtypes=(torch.float32, torch.float64), device=device)
    if tuple(scale.shape) not in ((rows, 1), (1,)):
        raise ValueError(f"{op}: {name} has shape {tuple(scale.shape)}, expected ({rows}, 1) or (1,)")


def validate_scaled_linear(op, qdtype, x_q, x_scale, w_q, w_scale, bias, out_dtype) -> None:
    """Shared checks of fp8_linear and int8_linear (quantized operands of dtype `qdtype`)."""
    device = device_of(x_q)
    check_tensor(op, "x", x_q, ndim=2, dtypes=(qdtype,))
    check_tensor(op, "weight", w_q, ndim=2, dtypes=(qdtype,), device=device)
    if w_q.shape[1] != x_q.shape[1]:
        raise ValueError(f"{op}: weight has {w_q.shape[1]} in-features, expected x's K = {x_q.shape[1]}")
    _check_scale(op, "x_scale", x_scale, x_q.shape[0], device)
    _check_scale(op, "w_scale", w_scale, w_q.shape[0], device)
    if dtype_name(out_dtype) not in {dtype_name(d) for d in FLOAT_DTYPES}:  # by name: torch or jnp dtypes
        raise ValueError(f"{op}: out_dtype {out_dtype} unsupported, expected float32, float16 or bfloat16")
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, device=device)
        if bias.shape[0] != w_q.shape[0]:
            raise ValueError(f"{op}: bias has {bias.shape[0]} elements, expected out-features {w_q.shape[0]}")


def scaled_linear_fake(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    return x_q.new_empty((*x_q.shape[:-1], w_q.shape[0]), dtype=out_dtype)


def scaled_linear_call_case(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    """The case of an fp8_linear / int8_linear call (its dtype is the output's)."""
    shape = {"M": math.prod(x_q.shape[:-1]), "N": w_q.shape[0], "K": x_q.shape[-1]}
    return {**shape, "per_token": x_scale.numel() > 1, "bias": bias is not None}, out_dtype


def make_quantize_inputs(shape, dtype, device, generator) -> dict:
    """x [M, K] for the activation quantizers: values well away from zero, a few outliers."""
    return {"x": randn((shape["M"], shape["K"]), dtype, device, generator, scale=3.0)}


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


def scaled_linear_cpu(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    """The CPU path of both GEMMs: a float32 matmul of the raw int8 / fp8 values (exact below 2^24),
    the scales applied to the result."""
    out = (x_q.float() @ w_q.float().T) * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)
