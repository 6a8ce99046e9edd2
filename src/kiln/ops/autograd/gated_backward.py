"""Autograd for the gated activations: torch.ops.kiln.silu_and_mul and .gelu_tanh_and_mul get a
backward (Triton kernel on CUDA / KILN_BACKEND=triton, plain torch otherwise), registered with
torch.library.register_autograd so eager autograd and torch.compile both see it."""

from __future__ import annotations

import math

import torch

from kiln.ops.autograd.dispatch import use_triton
from kiln.ops.autograd.gated_backward_triton import gated_backward_triton
from kiln.ops.testing import compute_dtype


def gated_backward_torch(x: torch.Tensor, grad_y: torch.Tensor, activation: str) -> torch.Tensor:
    """grad_x [..., 2d] in x's dtype; math in float32 (float64 for float64 inputs)."""
    xf = x.to(compute_dtype(x.dtype))
    d = x.shape[-1] // 2
    gate, up = xf[..., :d], xf[..., d:]
    g = grad_y.to(xf.dtype)
    if activation == "silu":
        s = torch.sigmoid(gate)
        act, act_grad = gate * s, s * (1 + gate * (1 - s))
    else:
        # tanh-GELU 0.5 a (1 + tanh(z)) = a sigmoid(2z), z = k (a + c a^3), written with sigmoids as
        # the Triton kernel does: 1 + tanh(z) cancels in float32 for negative a (1e-4 relative error
        # at a = -4), sigmoid(2z) does not.
        k = math.sqrt(2 / math.pi)
        s = torch.sigmoid(2 * k * (gate + 0.044715 * gate**3))
        act = gate * s
        act_grad = s + gate * s * torch.sigmoid(-2 * k * (gate + 0.044715 * gate**3)) * (
            2 * k * (1 + 3 * 0.044715 * gate * gate)
        )
    return torch.cat([g * up * act_grad, g * act], dim=-1).to(x.dtype)


# The backward is a custom op of its own (with a fake), so torch.compile traces it as one node
# instead of tracing into a Triton launch with fake tensors.
@torch.library.custom_op("kiln::gated_activation_backward", mutates_args=())
def gated_backward(x: torch.Tensor, grad_y: torch.Tensor, activation: str) -> torch.Tensor:
    """grad_x [..., 2d] of y = act(x[..., :d]) * x[..., d:]; activation "silu" | "gelu_tanh"."""
    if use_triton(x):
        return gated_backward_triton(x, grad_y, activation)
    return gated_backward_torch(x, grad_y, activation)


@gated_backward.register_fake
def _(x, grad_y, activation):
    return torch.empty_like(x)


def _save_x(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _silu_and_mul_backward(ctx, grad_y):
    (x,) = ctx.saved_tensors
    return torch.ops.kiln.gated_activation_backward(x, grad_y, "silu")


def _gelu_tanh_and_mul_backward(ctx, grad_y):
    (x,) = ctx.saved_tensors
    return torch.ops.kiln.gated_activation_backward(x, grad_y, "gelu_tanh")


torch.library.register_autograd("kiln::silu_and_mul", _silu_and_mul_backward, setup_context=_save_x)
torch.library.register_autograd("kiln::gelu_tanh_and_mul", _gelu_tanh_and_mul_backward, setup_context=_save_x)
