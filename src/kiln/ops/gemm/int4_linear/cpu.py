"""CPU int4_linear: the weight dequantized (kiln.quant.int4) in float32 (float64 for float64 x),
then PyTorch's GEMM, the result rounded to x's dtype once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.int4_linear.spec import INT4_LINEAR
from kiln.ops.registry import Implementation, cpu_only
from kiln.quant.int4 import dequantize_int4


def int4_linear_cpu(x, qweight, scales, zeros, group_size):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_int4(qweight, scales, zeros, group_size, x.shape[-1], dtype=compute)
    return F.linear(x.to(compute), w).to(x.dtype)


INT4_LINEAR.register(Implementation("cpu", int4_linear_cpu, cpu_only))
