"""rms_norm: RMSNorm over the last dim, optionally fused with the residual add.

    x:        [..., hidden]  float32 / float16 / bfloat16
    weight:   [hidden]       same dtype as x
    residual: [..., hidden]  same shape and dtype as x, or None
    weight_offset: float, 0.0 by default
    y = x / sqrt(mean(x^2, -1) + eps) * (weight_offset + weight), statistics in float32.
    With `residual`, first s = x + residual is written back into `residual` (in place; the new
    residual stream of a Llama layer), then y = rms_norm(s). Returns y, or (y, residual).
    `weight_offset=1.0` is Gemma's norm (checkpoints store weight - 1): the offset is added in
    float32 inside the kernel, so a bfloat16 weight near 0 keeps its precision (1 + w rounded to
    bfloat16 would not).
"""

from __future__ import annotations

import math

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_last_dim, check_same_dtype, check_tensor, device_of, row_count
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import (
    ONE_ROUNDING_POINTWISE,
    ONE_ROUNDING_TOLERANCE,
    compute_dtype,
    element_size,
    randn,
)


def rms_norm_reference(x, weight, eps=1e-6, residual=None, weight_offset=0.0):
    xf = x.to(compute_dtype(x.dtype))
    if residual is not None:
        xf = xf + residual.to(xf.dtype)
        residual.copy_(xf)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (xf * inv_rms * (weight.to(xf.dtype) + weight_offset)).to(x.dtype)
    return out if residual is None else (out, residual)


def validate_rms_norm(x, weight, eps, residual, weight_offset=0.0) -> None:
    op = "rms_norm"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    check_tensor(op, "weight", weight, ndim=1, device=device_of(x))
    check_last_dim(op, "weight", weight, x.shape[-1], "x's hidden size")
    check_same_dtype(op, x=x, weight=weight)
    if residual is not None:
        check_tensor(op, "residual", residual, device=device_of(x))
        if residual.shape != x.shape:
            raise ValueError(
                f"rms_norm: residual has shape {tuple(residual.shape)}, expected x's {tuple(x.shape)}"
            )
        check_same_dtype(op, x=x, residual=residual)
    if not eps > 0:
        raise ValueError(f"rms_norm: eps must be positive, got {eps}")
    if not math.isfinite(weight_offset):
        raise ValueError(f"rms_norm: weight_offset must be a finite number, got {weight_offset}")


def _make_inputs(shape, dtype, device, generator):
    rows, hidden = shape["rows"], shape["hidden"]
    # "offset": Gemma's layout, weights around 0 and the 1 added by the kernel.
    offset = 1.0 if shape.get("offset") else 0.0
    inputs = {
        "x": randn((rows, hidden), dtype, device, generator),
        "weight": randn((hidden,), dtype, device, generator, scale=0.5) + (1.0 - offset),
        "eps": 1e-6,
        "residual": randn((rows, hidden), dtype, device, generator) if shape.get("residual") else None,
        "weight_offset": offset,
    }
    return inputs


def _fuzz_shapes(rng):
    shapes = [
        {"rows": 1, "hidden": 1},
        {"rows": 1, "hidden": 4096},
        {"rows": 7, "hidden": 576, "residual": True},
        {"rows": 3, "hidden": 5000, "residual": True},
        {"rows": 9, "hidden": 256, "offset": True},  # Gemma's norm (per-head q/k norm: rows = T * H)
        {"rows": 3, "hidden": 9001, "residual": True, "offset": True},
    ]
    shapes += [
        {"rows": rng.randint(1, 64), "hidden": rng.randint(1, 3000), "residual": rng.random() < 0.5}
        for _ in range(3)
    ]
    return shapes


def _bytes(shape, dtype):
    n = shape["rows"] * shape["hidden"]
    tensors = 4 if shape.get("residual") else 2  # x, y (+ residual read and written)
    return (tensors * n + shape["hidden"]) * element_size(dtype)


def _llm_shapes():
    shapes = []
    for hidden in (576, 4096, 8192):  # SmolLM2-135M, Llama-3-8B, Llama-3-70B
        for rows in (1, 64, 4096):
            shapes.append({"rows": rows, "hidden": hidden, "residual": True})
    return shapes


def _torch_eager(x, weight, eps=1e-6, residual=None, weight_offset=0.0):
    if residual is not None:
        x = x + residual
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight + weight_offset, eps)


RMS_NORM = OpSpec(
    name="rms_norm",
    description="RMSNorm over the last dim, optionally fused with the residual add",
    reference=rms_norm_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # fp32: only summation order differs; halves: one rounding of the output (2^-11, 2^-8).
    tolerance=ONE_ROUNDING_TOLERANCE,
    # with a residual, the sum may be rounded to the dtype (the residual it writes) before it is
    # normalized, as an add then a norm in the model's dtype does (HF): two roundings per element,
    # and the rms of the rounded sums moves every element a little more (2.13 measured)
    pointwise={dtype: 2.5 for dtype in ONE_ROUNDING_POINTWISE},
    flops=lambda s, dtype: s["rows"] * s["hidden"] * (5 if s.get("residual") else 4),
    bytes=_bytes,
    bench_shapes={"llm": _llm_shapes()},
    baselines={"torch_eager": _torch_eager},
    schema=(
        "(Tensor x, Tensor weight, float eps=1e-06, Tensor(a!)? residual=None, "
        "float weight_offset=0.0) -> Tensor"
    ),
    validate=validate_rms_norm,
    fake=lambda x, weight, eps, residual, weight_offset: torch.empty_like(x),
    call_case=lambda x, weight, eps, residual, weight_offset: (
        {"rows": row_count(x), "hidden": x.shape[-1], "residual": residual is not None},
        x.dtype,
    ),
    public_result=lambda y, args: y if args[3] is None else (y, args[3]),
    doc=__doc__,
)

rms_norm = define_op(RMS_NORM, "kiln.ops")
