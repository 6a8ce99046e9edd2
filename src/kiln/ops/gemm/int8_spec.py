"""INT8 W8A8: symmetric per-token activation quantization and the int8 GEMM.

quantize_int8(x)
    x: [M, K] float32 / float16 / bfloat16
    -> (x_int8 [M, K] int8, scale float32 [M, 1]) with scale = max(amax_row, 1e-12) / 127 and
    x_int8 = round-half-away-from-zero(x / scale), so x ~= x_int8 * scale.

int8_linear(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16)
    x_int8 [M, K], x_scale float32 [M, 1] or [1]; w_int8 [N, K], w_scale float32 [N, 1] or [1];
    bias [N] or None. y = (x_int8 @ w_int8^T) * x_scale * w_scale^T + bias, [M, N] in out_dtype,
    with the dot product accumulated exactly in int32 (|sum| <= K * 127^2 < 2^31 for K < 133,000).
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor
from kiln.ops.gemm.fp8_spec import AMAX_FLOOR, make_scaled_linear_inputs, validate_scaled_linear
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
from kiln.ops.testing import compute_dtype, randint, randn

INT8_MAX = 127.0


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: ties go away from zero (what the kernels do)."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_int8_reference(x):
    xf = x.to(compute_dtype(x.dtype))
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / INT8_MAX
    return round_half_away(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_linear_reference(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """Exact product in x_scale's float dtype (float64 under the verifier)."""
    dtype = x_scale.dtype
    out = (x_int8.to(dtype) @ w_int8.to(dtype).T) * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    return out if bias is None else out + bias.to(dtype)


def _make_quantize_inputs(shape, dtype, device, generator):
    return {"x": randn((shape["M"], shape["K"]), dtype, device, generator, scale=3.0)}


def _make_int8_linear_inputs(shape, dtype, device, generator):
    def make_q(size):
        return randint(size, -127, 128, torch.int8, device, generator)

    return make_scaled_linear_inputs(shape, dtype, device, generator, "int8", make_q)


def _torch_int_mm(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16):
    """cuBLAS int8 GEMM (torch._int_mm, int32 out) then the scales in float32."""
    out = torch._int_mm(x_int8, w_int8.T).float() * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    return (out if bias is None else out + bias).to(out_dtype)


QUANTIZE_INT8 = register_op(
    OpSpec(
        name="quantize_int8",
        description="fused per-token amax + scale + round to int8 (symmetric)",
        reference=quantize_int8_reference,
        make_inputs=_make_quantize_inputs,
        fuzz_shapes=fuzz_quantize_shapes,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # float32 vs float64 division: an element can round the other way only within ~1e-7 of a .5 tie
        # (one int8 step in a rare element); the scale is one float32 rounding.
        tolerance={torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 5e-3},
        flops=quantize_flops,
        bytes=quantize_bytes,
        outputs=lambda result, inputs: result,
        bench_shapes={"llm": [{"M": m, "K": k} for k in (4096, 14336, 576) for m in (1, 64, 2048, 8192)]},
    )
)

INT8_LINEAR = register_op(
    OpSpec(
        name="int8_linear",
        description="W8A8: int32-accumulated int8 GEMM with per-token x per-channel scales (+ bias)",
        reference=int8_linear_reference,
        make_inputs=_make_int8_linear_inputs,
        fuzz_shapes=fuzz_scaled_gemm_shapes,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),  # out_dtype
        # The int32 dot is exact; the scales add one float32 rounding, the output one out_dtype rounding.
        tolerance=GEMM_TOLERANCE,
        flops=gemm_flops,
        bytes=scaled_gemm_bytes,
        bench_shapes={"llm": llm_shapes(per_token=True)},
        baselines={"torch_int_mm": _torch_int_mm},
    )
)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` float -> (x_int8 `[M, K]`, scale float32 `[M, 1]`), symmetric per token."""
    check_tensor("quantize_int8", "x", x, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    return QUANTIZE_INT8(x)


def int8_linear(
    x_int8: torch.Tensor,
    x_scale: torch.Tensor,
    w_int8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(x_int8 @ w_int8^T) * x_scale * w_scale^T + bias -> `[M, N]` out_dtype, int32 accumulation."""
    validate_scaled_linear("int8_linear", torch.int8, x_int8, x_scale, w_int8, w_scale, bias, out_dtype)
    return INT8_LINEAR(x_int8, x_scale, w_int8, w_scale, bias, out_dtype)
