"""fp8_linear: the FP8 (e4m3fn) W8A8 GEMM with per-tensor or per-token x per-channel scales.

x_fp8:   [M, K] float8_e4m3fn     x_scale: float32 [M, 1] (per token) or [1] (per tensor)
w_fp8:   [N, K] float8_e4m3fn     w_scale: float32 [N, 1] (per channel) or [1]
bias:    [N] in out_dtype, or None
y = (x_fp8 * x_scale) @ (w_fp8 * w_scale)^T + bias, [M, N] in out_dtype (float32 / float16 /
bfloat16, default bfloat16); float32 accumulation. `quantize_fp8` makes x_fp8 and x_scale.
"""

from __future__ import annotations

import torch

from kiln.ops.gemm.dense_baseline import bf16_matmul
from kiln.ops.gemm.scaled import (
    FP8_DTYPE,
    FP8_MAX,
    make_scaled_linear_inputs,
    scaled_linear_call_case,
    scaled_linear_fake,
    validate_scaled_linear,
)
from kiln.ops.gemm.shapes import (
    FP8_FLOAT32_TOLERANCE,
    GEMM_TOLERANCE,
    fuzz_scaled_gemm_shapes,
    gemm_flops,
    llm_shapes,
    quant_shapes,
    scaled_gemm_bytes,
)
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import randn


def fp8_linear_reference(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """Exact product of the dequantized inputs (float64 under the verifier; out_dtype only says
    what the kernels round to)."""
    dtype = x_scale.dtype
    x = x_fp8.to(dtype) * x_scale.reshape(-1, 1)
    w = w_fp8.to(dtype) * w_scale.reshape(-1, 1)
    out = x @ w.T
    return out if bias is None else out + bias.to(dtype)


def validate_fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype) -> None:
    validate_scaled_linear("fp8_linear", FP8_DTYPE, x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)


def _make_inputs(shape, dtype, device, generator):
    def make_q(size):
        return (
            randn(size, torch.float32, device, generator, scale=40.0).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        )

    return make_scaled_linear_inputs(shape, dtype, device, generator, "fp8", make_q)


def _scaled_mm(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """cuBLASLt FP8 GEMM through torch (per-tensor or row-wise scales)."""
    xs = x_scale if x_scale.dim() == 2 else x_scale.reshape(())
    ws = w_scale.reshape(1, -1) if w_scale.dim() == 2 else w_scale.reshape(())
    return torch._scaled_mm(x_fp8, w_fp8.T, scale_a=xs, scale_b=ws, bias=bias, out_dtype=out_dtype)


def _bf16_matmul(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """The same layer as a bf16 GEMM on the dequantized weight (dense_baseline)."""
    x = x_fp8.to(torch.bfloat16) * x_scale.reshape(-1, 1).to(torch.bfloat16)
    return bf16_matmul(x, w_fp8, lambda: w_fp8.float() * w_scale.reshape(-1, 1), bias)


FP8_LINEAR = OpSpec(
    name="fp8_linear",
    description="(x_fp8 * x_scale) @ (w_fp8 * w_scale)^T (+ bias), per-tensor or per-token x per-channel",
    reference=fp8_linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=fuzz_scaled_gemm_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),  # out_dtype
    # Reference uses the same (quantized) inputs: only the accumulation and the output rounding remain
    # (float32: Hopper's fp8 accumulator, FP8_FLOAT32_TOLERANCE).
    tolerance={**GEMM_TOLERANCE, torch.float32: FP8_FLOAT32_TOLERANCE},
    flops=gemm_flops,
    matmul_dtype=lambda shape, dtype: torch.float8_e4m3fn,  # dtype is the output's
    bytes=scaled_gemm_bytes,
    bench_shapes={"llm": llm_shapes(per_token=True), "quant": quant_shapes(per_token=True)},
    baselines={"torch_scaled_mm": _scaled_mm, "torch_bf16_matmul": _bf16_matmul},
    schema=(
        "(Tensor x_fp8, Tensor x_scale, Tensor w_fp8, Tensor w_scale, Tensor? bias=None, "
        "ScalarType out_dtype=bfloat16) -> Tensor"
    ),
    validate=validate_fp8_linear,
    fake=scaled_linear_fake,
    call_case=scaled_linear_call_case,
    doc=__doc__,
)

fp8_linear = define_op(FP8_LINEAR, "kiln.ops")
