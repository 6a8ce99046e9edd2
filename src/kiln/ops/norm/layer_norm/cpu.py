"""Fast CPU LayerNorm: PyTorch's fused CPU operator."""

from __future__ import annotations

import torch

from kiln.ops.norm.layer_norm.spec import LAYER_NORM
from kiln.ops.registry import Implementation, cpu_only


def layer_norm_cpu(x, weight, bias=None, eps=1e-5):
    # PyTorch's CPU LayerNorm accumulates half-precision inputs in float32 itself: no upcast copy needed.
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


LAYER_NORM.register(Implementation("cpu", layer_norm_cpu, cpu_only))
