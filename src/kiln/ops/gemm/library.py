"""The GEMM family as `torch.library` custom ops, `torch.ops.kiln.<name>` (see kiln/ops/library.py for
why): each wraps the public function (validation + dispatch) and has a fake that only validates and
allocates the output, so `torch.compile(fullgraph=True)` and CUDA graphs take the kernels as they are.

    linear, linear_silu_mul, fp8_linear, int8_linear, int4_linear, gguf_linear -> [..., N]
    quantize_fp8, quantize_int8 -> (quantized, scale);  gguf_dequantize -> [N, K]
"""

from __future__ import annotations

import torch

from kiln.ops.checks import check_tensor
from kiln.ops.gemm.dense_spec import linear, linear_silu_mul, validate_linear
from kiln.ops.gemm.fp8_spec import FP8_DTYPE, fp8_linear, quantize_fp8, validate_scaled_linear
from kiln.ops.gemm.gguf_spec import gguf_dequantize, gguf_linear, validate_gguf_weight
from kiln.ops.gemm.int4_spec import int4_linear, validate_int4_linear
from kiln.ops.gemm.int8_spec import int8_linear, quantize_int8

REGISTERED = (
    "linear",
    "linear_silu_mul",
    "quantize_fp8",
    "fp8_linear",
    "quantize_int8",
    "int8_linear",
    "int4_linear",
    "gguf_dequantize",
    "gguf_linear",
)


def _out(x: torch.Tensor, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n), dtype=dtype or x.dtype)


@torch.library.custom_op("kiln::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias=None):
    validate_linear("linear", x, weight, bias)
    return _out(x, weight.shape[0])


@torch.library.custom_op("kiln::linear_silu_mul", mutates_args=())
def _linear_silu_mul_op(x: torch.Tensor, weight_gate_up: torch.Tensor) -> torch.Tensor:
    return linear_silu_mul(x, weight_gate_up)


@_linear_silu_mul_op.register_fake
def _(x, weight_gate_up):
    validate_linear("linear_silu_mul", x, weight_gate_up)
    return _out(x, weight_gate_up.shape[0] // 2)


@torch.library.custom_op("kiln::quantize_fp8", mutates_args=())
def _quantize_fp8_op(x: torch.Tensor, per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8(x, per_token)


@_quantize_fp8_op.register_fake
def _(x, per_token=True):
    check_tensor("quantize_fp8", "x", x, ndim=2)
    scale_shape = (x.shape[0], 1) if per_token else (1,)
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(scale_shape, dtype=torch.float32)


@torch.library.custom_op("kiln::quantize_int8", mutates_args=())
def _quantize_int8_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(x)


@_quantize_int8_op.register_fake
def _(x):
    check_tensor("quantize_int8", "x", x, ndim=2)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("kiln::fp8_linear", mutates_args=())
def _fp8_linear_op(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    return fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)


@_fp8_linear_op.register_fake
def _(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    validate_scaled_linear("fp8_linear", FP8_DTYPE, x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    return _out(x_fp8, w_fp8.shape[0], out_dtype)


@torch.library.custom_op("kiln::int8_linear", mutates_args=())
def _int8_linear_op(
    x_int8: torch.Tensor,
    x_scale: torch.Tensor,
    w_int8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    return int8_linear(x_int8, x_scale, w_int8, w_scale, bias, out_dtype)


@_int8_linear_op.register_fake
def _(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16):
    validate_scaled_linear("int8_linear", torch.int8, x_int8, x_scale, w_int8, w_scale, bias, out_dtype)
    return _out(x_int8, w_int8.shape[0], out_dtype)


@torch.library.custom_op("kiln::int4_linear", mutates_args=())
def _int4_linear_op(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    return int4_linear(x, qweight, scales, zeros, group_size)


@_int4_linear_op.register_fake
def _(x, qweight, scales, zeros, group_size):
    validate_int4_linear(x, qweight, scales, zeros, group_size)
    return _out(x, qweight.shape[0])


@torch.library.custom_op("kiln::gguf_dequantize", mutates_args=())
def _gguf_dequantize_op(
    qweight: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return gguf_dequantize(qweight, qtype, dtype)


@_gguf_dequantize_op.register_fake
def _(qweight, qtype, dtype=torch.float32):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    except KeyError:
        raise ValueError(f"gguf_dequantize: unknown GGML type {qtype!r}") from None
    return qweight.new_empty((qweight.shape[0], qweight.shape[1] // type_size * block), dtype=dtype)


@torch.library.custom_op("kiln::gguf_linear", mutates_args=())
def _gguf_linear_op(
    x: torch.Tensor, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return gguf_linear(x, qweight, qtype, bias)


@_gguf_linear_op.register_fake
def _(x, qweight, qtype, bias=None):
    validate_gguf_weight("gguf_linear", qweight, qtype, x.shape[-1], x.device)
    return _out(x, qweight.shape[0])
