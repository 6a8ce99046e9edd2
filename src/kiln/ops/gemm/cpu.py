"""CPU paths of the GEMM family: PyTorch's matmul, in float32 for half-precision inputs (CPU halves
have no fast fused GEMM everywhere); quantized weights are dequantized, then multiplied."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.dense_spec import LINEAR, LINEAR_SILU_MUL
from kiln.ops.gemm.fp8_spec import AMAX_FLOOR, FP8_DTYPE, FP8_LINEAR, FP8_MAX, QUANTIZE_FP8
from kiln.ops.gemm.gguf_spec import GGUF_DEQUANTIZE, GGUF_LINEAR
from kiln.ops.gemm.int4_spec import INT4_LINEAR
from kiln.ops.gemm.int8_spec import INT8_LINEAR, INT8_MAX, QUANTIZE_INT8, round_half_away
from kiln.ops.registry import Implementation
from kiln.quant.gguf_blocks import dequantize_blocks
from kiln.quant.int4 import dequantize_int4


def _cpu_only(device):
    return device is None or device.type == "cpu"


def _as_compute(t: torch.Tensor | None) -> torch.Tensor | None:
    """float32 for halves; float32/float64 stay as they are."""
    if t is None:
        return None
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def linear_cpu(x, weight, bias=None):
    return F.linear(_as_compute(x), _as_compute(weight), _as_compute(bias)).to(x.dtype)


def linear_silu_mul_cpu(x, weight_gate_up):
    gate, up = F.linear(_as_compute(x), _as_compute(weight_gate_up)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def quantize_fp8_cpu(x, per_token=True):
    xf = _as_compute(x)
    amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax().reshape(1)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.float()


def quantize_int8_cpu(x):
    xf = _as_compute(x)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / INT8_MAX
    return round_half_away(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale.float()


def _scaled_linear_cpu(x_q, x_scale, w_q, w_scale, bias, out_dtype):
    # float32 matmul of the raw int8 / fp8 values (exact below 2^24), scales applied to the result.
    out = (x_q.float() @ w_q.float().T) * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)


def fp8_linear_cpu(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    return _scaled_linear_cpu(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)


def int8_linear_cpu(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16):
    return _scaled_linear_cpu(x_int8, x_scale, w_int8, w_scale, bias, out_dtype)


def int4_linear_cpu(x, qweight, scales, zeros, group_size):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_int4(qweight, scales, zeros, group_size, x.shape[-1], dtype=compute)
    return F.linear(x.to(compute), w).to(x.dtype)


def gguf_dequantize_cpu(qweight, qtype, dtype=torch.float32):
    return dequantize_blocks(qweight, qtype, dtype)


def gguf_linear_cpu(x, qweight, qtype, bias=None):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_blocks(qweight, qtype, compute)
    return F.linear(x.to(compute), w, None if bias is None else bias.to(compute)).to(x.dtype)


LINEAR.register(Implementation("cpu", linear_cpu, _cpu_only))
LINEAR_SILU_MUL.register(Implementation("cpu", linear_silu_mul_cpu, _cpu_only))
QUANTIZE_FP8.register(Implementation("cpu", quantize_fp8_cpu, _cpu_only))
QUANTIZE_INT8.register(Implementation("cpu", quantize_int8_cpu, _cpu_only))
FP8_LINEAR.register(Implementation("cpu", fp8_linear_cpu, _cpu_only))
INT8_LINEAR.register(Implementation("cpu", int8_linear_cpu, _cpu_only))
INT4_LINEAR.register(Implementation("cpu", int4_linear_cpu, _cpu_only))
GGUF_DEQUANTIZE.register(Implementation("cpu", gguf_dequantize_cpu, _cpu_only))
GGUF_LINEAR.register(Implementation("cpu", gguf_linear_cpu, _cpu_only))
