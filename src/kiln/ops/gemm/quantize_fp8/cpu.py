"""CPU quantize_fp8: amax and scale in float32 (float64 stays float64), torch's e4m3 cast."""

from __future__ import annotations

from kiln.ops.gemm.quantize_fp8.spec import QUANTIZE_FP8
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from kiln.ops.registry import Implementation, cpu_only
from kiln.ops.testing import compute_dtype


def quantize_fp8_cpu(x, per_token=True):
    xf = x.to(compute_dtype(x.dtype))
    amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax().reshape(1)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.float()


QUANTIZE_FP8.register(Implementation("cpu", quantize_fp8_cpu, cpu_only))
