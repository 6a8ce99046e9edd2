"""CPU w8a16_linear: the weight dequantized into x's dtype (one rounding of w * scale), then
PyTorch's fused CPU GEMM. Scaling the weight first, not the output, keeps fp16 partial sums in range.
It is also the bench's "torch_dequant_linear" baseline: what PyTorch alone does with these weights."""

from __future__ import annotations

import torch

from kiln.ops.gemm.w8a16_linear.spec import W8A16_LINEAR
from kiln.ops.registry import Implementation, cpu_only


def w8a16_linear_cpu(x, weight, weight_scale, bias=None):
    w = (weight.to(torch.float32) * weight_scale.reshape(-1, 1).to(torch.float32)).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


W8A16_LINEAR.register(Implementation("cpu", w8a16_linear_cpu, cpu_only))
W8A16_LINEAR.baselines.setdefault("torch_dequant_linear", w8a16_linear_cpu)
