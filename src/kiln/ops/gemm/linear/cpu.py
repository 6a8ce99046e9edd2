"""Fast CPU linear: PyTorch's GEMM, in float32 for half-precision inputs (CPU halves have no fast fused
GEMM everywhere), the result rounded to x's dtype once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.linear.spec import LINEAR
from kiln.ops.registry import Implementation, cpu_only


def as_compute(t: torch.Tensor | None) -> torch.Tensor | None:
    """float32 for halves; float32 / float64 stay as they are (no copy)."""
    if t is None:
        return None
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def linear_cpu(x, weight, bias=None):
    return F.linear(as_compute(x), as_compute(weight), as_compute(bias)).to(x.dtype)


LINEAR.register(Implementation("cpu", linear_cpu, cpu_only))
