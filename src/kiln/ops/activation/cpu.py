"""Fast CPU paths for the gated activations: PyTorch's vectorized CPU silu/gelu and an in-place multiply."""

from __future__ import annotations

import torch

from kiln.ops.activation.spec import GELU_TANH_AND_MUL, SILU_AND_MUL
from kiln.ops.registry import Implementation


def _cpu_only(device):
    return device is None or device.type == "cpu"


def silu_and_mul_cpu(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]).mul_(x[..., d:])


def gelu_tanh_and_mul_cpu(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])


SILU_AND_MUL.register(Implementation("cpu", silu_and_mul_cpu, _cpu_only))
GELU_TANH_AND_MUL.register(Implementation("cpu", gelu_tanh_and_mul_cpu, _cpu_only))
