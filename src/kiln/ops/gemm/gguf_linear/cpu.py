"""CPU gguf_linear: the weight decoded in float32 (float64 for float64 x) by kiln.quant, then
PyTorch's GEMM, the result rounded to x's dtype once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.gguf_linear.spec import GGUF_LINEAR
from kiln.ops.registry import Implementation, cpu_only
from kiln.quant.gguf_blocks import dequantize_blocks


def gguf_linear_cpu(x, qweight, qtype, bias=None):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_blocks(qweight, qtype, compute)
    return F.linear(x.to(compute), w, None if bias is None else bias.to(compute)).to(x.dtype)


GGUF_LINEAR.register(Implementation("cpu", gguf_linear_cpu, cpu_only))
