"""linear: the dense GEMM in the checkpoint's [out, in] weight layout.

x:      [..., K]   float32 / float16 / bfloat16
weight: [N, K]     same dtype as x
bias:   [N] or None, same dtype
y = x @ weight^T + bias, shape [..., N], dtype of x; accumulation in float32.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_last_dim, check_same_dtype, check_tensor, device_of, row_count
from kiln.ops.gemm.shapes import (
    GEMM_TOLERANCE,
    dense_gemm_bytes,
    fuzz_gemm_shapes,
    gemm_flops,
    llm_shapes,
    quant_shapes,
)
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import randn


def linear_reference(x, weight, bias=None):
    out = x @ weight.T
    return out if bias is None else out + bias


def check_dense_operands(op: str, x, weight, bias=None) -> None:
    """x [..., K] float and weight [rows, K] of x's dtype (+ bias [rows]): linear's and
    linear_silu_mul's operand contract."""
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    check_tensor(op, "weight", weight, ndim=2, device=device_of(x))
    check_last_dim(op, "weight", weight, x.shape[-1], "x's in-features")
    check_same_dtype(op, x=x, weight=weight)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, device=device_of(x))
        check_last_dim(op, "bias", bias, weight.shape[0], "weight's out-features")
        check_same_dtype(op, x=x, bias=bias)


def validate_linear(x, weight, bias) -> None:
    check_dense_operands("linear", x, weight, bias)


def _make_inputs(shape, dtype, device, generator):
    M, N, K = shape["M"], shape["N"], shape["K"]
    return {
        "x": randn((M, K), dtype, device, generator),
        "weight": randn((N, K), dtype, device, generator, scale=K**-0.5),
        "bias": randn((N,), dtype, device, generator) if shape.get("bias") else None,
    }


def _fuzz_shapes(rng):
    shapes = fuzz_gemm_shapes(rng)
    return [{**s, "bias": i % 2 == 0} for i, s in enumerate(shapes)]


def _torch_linear(x, weight, bias=None):
    return torch.nn.functional.linear(x, weight, bias)


LINEAR = OpSpec(
    name="linear",
    description="y = x @ W^T (+ bias), W in [out, in] layout",
    reference=linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    tolerance=GEMM_TOLERANCE,
    flops=gemm_flops,
    bytes=lambda s, dtype: dense_gemm_bytes(s, dtype, 1),
    bench_shapes={"llm": llm_shapes(bias=False), "quant": quant_shapes(bias=False)},
    baselines={"torch_matmul": _torch_linear},
    gpu_only_dtypes={"triton": (torch.bfloat16,)},
    schema="(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
    validate=validate_linear,
    fake=lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])),
    call_case=lambda x, weight, bias: (
        {"M": row_count(x), "N": weight.shape[0], "K": x.shape[-1], "bias": bias is not None},
        x.dtype,
    ),
    doc=__doc__,
)

linear = define_op(LINEAR, "kiln.ops")
