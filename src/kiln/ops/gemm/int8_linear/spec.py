"""int8_linear: the INT8 W8A8 GEMM, int32 accumulation, per-token x per-channel scales.

x_int8: [M, K] int8     x_scale: float32 [M, 1] (per token) or [1] (per tensor)
w_int8: [N, K] int8     w_scale: float32 [N, 1] (per channel) or [1]
bias:   [N] or None
y = (x_int8 @ w_int8^T) * x_scale * w_scale^T + bias, [M, N] in out_dtype (float32 / float16 /
bfloat16, default bfloat16), with the dot product accumulated exactly in int32
(|sum| <= K * 127^2 < 2^31 for K < 133,000). `quantize_int8` makes x_int8 and x_scale.
"""

from __future__ import annotations

import torch

from kiln.ops.gemm.dense_baseline import bf16_matmul
from kiln.ops.gemm.scaled import (
    make_scaled_linear_inputs,
    scaled_linear_call_case,
    scaled_linear_fake,
    validate_scaled_linear,
)
from kiln.ops.gemm.shapes import (
    GEMM_TOLERANCE,
    fuzz_scaled_gemm_shapes,
    gemm_flops,
    llm_shapes,
    quant_shapes,
    scaled_gemm_bytes,
)
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import randint


def int8_linear_reference(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """Exact product in x_scale's float dtype (float64 under the verifier)."""
    dtype = x_scale.dtype
    out = (x_int8.to(dtype) @ w_int8.to(dtype).T) * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    return out if bias is None else out + bias.to(dtype)


def validate_int8_linear(x_int8, x_scale, w_int8, w_scale, bias, out_dtype) -> None:
    validate_scaled_linear("int8_linear", torch.int8, x_int8, x_scale, w_int8, w_scale, bias, out_dtype)


def _make_inputs(shape, dtype, device, generator):
    def make_q(size):
        return randint(size, -127, 128, torch.int8, device, generator)

    return make_scaled_linear_inputs(shape, dtype, device, generator, "int8", make_q)


def _torch_int_mm(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """cuBLAS int8 GEMM (torch._int_mm, int32 out) then the scales in float32."""
    out = torch._int_mm(x_int8, w_int8.T).float() * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    return (out if bias is None else out + bias).to(out_dtype)


def _bf16_matmul(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """The same layer as a bf16 GEMM on the dequantized weight (dense_baseline)."""
    x = x_int8.to(torch.bfloat16) * x_scale.reshape(-1, 1).to(torch.bfloat16)
    return bf16_matmul(x, w_int8, lambda: w_int8.float() * w_scale.reshape(-1, 1), bias)


INT8_LINEAR = OpSpec(
    name="int8_linear",
    description="W8A8: int32-accumulated int8 GEMM with per-token x per-channel scales (+ bias)",
    reference=int8_linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=fuzz_scaled_gemm_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),  # out_dtype
    # The int32 dot is exact; the scales add one float32 rounding, the output one out_dtype rounding.
    tolerance=GEMM_TOLERANCE,
    flops=gemm_flops,
    matmul_dtype=lambda shape, dtype: torch.int8,  # dtype is the output's
    bytes=scaled_gemm_bytes,
    bench_shapes={"llm": llm_shapes(per_token=True), "quant": quant_shapes(per_token=True)},
    baselines={"torch_int_mm": _torch_int_mm, "torch_bf16_matmul": _bf16_matmul},
    schema=(
        "(Tensor x_int8, Tensor x_scale, Tensor w_int8, Tensor w_scale, Tensor? bias=None, "
        "ScalarType out_dtype=bfloat16) -> Tensor"
    ),
    validate=validate_int8_linear,
    fake=scaled_linear_fake,
    call_case=scaled_linear_call_case,
    doc=__doc__,
)

int8_linear = define_op(INT8_LINEAR, "kiln.ops")
