"""Fast CPU paths for the norm family: PyTorch's fused CPU operators, statistics in float32."""

from __future__ import annotations

import torch

from kiln.ops.norm.spec import LAYER_NORM, RMS_NORM
from kiln.ops.registry import Implementation


def _cpu_only(device):
    return device is None or device.type == "cpu"


def rms_norm_cpu(x, weight, eps=1e-6, residual=None):
    if residual is not None:
        residual.add_(x)
        x = residual
    if x.dtype == torch.float32:
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        out = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return out if residual is None else (out, residual)


RMS_NORM.register(Implementation("cpu", rms_norm_cpu, _cpu_only))


def layer_norm_cpu(x, weight, bias=None, eps=1e-5):
    # PyTorch's CPU LayerNorm accumulates half-precision inputs in float32 itself: no upcast copy needed.
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


LAYER_NORM.register(Implementation("cpu", layer_norm_cpu, _cpu_only))
