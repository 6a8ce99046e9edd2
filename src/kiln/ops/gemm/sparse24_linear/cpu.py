"""CPU sparse24_linear: the weight expanded (exact) in float32 (float64 for float64 x), PyTorch's GEMM,
one rounding to x's dtype. The engine expands 2:4 weights once at load on the CPU instead
(kiln.ops.gemm.weight_formats), where no sparse kernel is faster than the dense one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.sparse24_linear.spec import SPARSE24_LINEAR
from kiln.ops.registry import Implementation, cpu_only
from kiln.quant.sparse24 import decompress_24


def sparse24_linear_cpu(x, values, meta, bias=None):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    weight = decompress_24(values, meta, compute)
    out = F.linear(x.to(compute), weight, None if bias is None else bias.to(compute))
    return out.to(x.dtype)


SPARSE24_LINEAR.register(Implementation("cpu", sparse24_linear_cpu, cpu_only))
