"""Fast CPU paths for the gated activations: PyTorch's vectorized CPU silu (gelu_tanh through sigmoid)
and in-place multiplies."""

from __future__ import annotations

import torch

from kiln.ops.activation.spec import GELU_TANH_AND_MUL, SILU_AND_MUL
from kiln.ops.registry import Implementation


def _cpu_only(device):
    return device is None or device.type == "cpu"


def silu_and_mul_cpu(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]).mul_(x[..., d:])


_TWO_SQRT_2_OVER_PI = 1.5957691216057308  # 2 * sqrt(2 / pi)


def gelu_tanh_and_mul_cpu(x):
    # 0.5 * (1 + tanh(z)) == sigmoid(2z). PyTorch's gelu(approximate="tanh") evaluates 1 + tanh(z),
    # which cancels for z << 0 (30% relative error in float32 at a = -5); sigmoid saturates cleanly.
    d = x.shape[-1] // 2
    gate = x[..., :d].to(torch.promote_types(x.dtype, torch.float32))
    z2 = (gate * gate).mul_(0.044715).add_(1.0).mul_(gate).mul_(_TWO_SQRT_2_OVER_PI)
    return torch.sigmoid_(z2).mul_(gate).mul_(x[..., d:]).to(x.dtype)


SILU_AND_MUL.register(Implementation("cpu", silu_and_mul_cpu, _cpu_only))
GELU_TANH_AND_MUL.register(Implementation("cpu", gelu_tanh_and_mul_cpu, _cpu_only))
