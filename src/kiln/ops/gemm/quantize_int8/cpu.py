"""CPU quantize_int8: amax and scale in float32 (float64 stays float64), round half away from zero."""

from __future__ import annotations

import torch

from kiln.ops.gemm.quantize_int8.spec import QUANTIZE_INT8, round_half_away
from kiln.ops.gemm.scaled import AMAX_FLOOR, INT8_MAX
from kiln.ops.registry import Implementation, cpu_only
from kiln.ops.testing import compute_dtype


def quantize_int8_cpu(x):
    xf = x.to(compute_dtype(x.dtype))
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / INT8_MAX
    return round_half_away(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale.float()


QUANTIZE_INT8.register(Implementation("cpu", quantize_int8_cpu, cpu_only))
