"""Fast CPU path for softmax: a few fused in-place PyTorch CPU ops, float32 math."""

from __future__ import annotations

import torch

from kiln.ops.registry import Implementation, cpu_only
from kiln.ops.softmax.softmax.spec import SOFTMAX

# Up to this row length torch.softmax stays within ~1.5e-6 of float64 (measured, fp32, logits of std
# up to 30); past it its summation drifts (1.2e-5 at a 128k vocabulary), so long rows take
# max + exp_ + sum (cascade summation) + div_, ~5e-7 there for ~15% more time.
FUSED_MAX_COLS = 32768


def softmax_cpu(x, temperature=1.0):
    # Halves go to float32 first, so the temperature never rounds the logits in half precision.
    if x.shape[-1] <= FUSED_MAX_COLS:
        xf = x if x.dtype == torch.float32 else x.float()
        if temperature != 1.0:
            xf = xf * (1.0 / temperature)
        out = torch.softmax(xf, dim=-1)
        return out if x.dtype == torch.float32 else out.to(x.dtype)
    if x.dtype == torch.float32:
        e = x - x.amax(dim=-1, keepdim=True)
    else:
        e = x.float()
        e.sub_(e.amax(dim=-1, keepdim=True))
    if temperature != 1.0:
        e.mul_(1.0 / temperature)  # (x - max) / T: the max of x / T is max(x) / T for T > 0
    e.exp_()
    e.div_(e.sum(dim=-1, keepdim=True))
    return e if x.dtype == torch.float32 else e.to(x.dtype)


SOFTMAX.register(Implementation("cpu", softmax_cpu, cpu_only))
