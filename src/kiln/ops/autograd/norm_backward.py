"""Autograd for the norms.

layer_norm is functional, so torch.ops.kiln.layer_norm gets its backward directly. rms_norm writes
its residual in place (`Tensor(a!)? residual` in its schema), and torch.library only differentiates
functional ops, so training goes through two functional custom ops over the same forward kernel:
    torch.ops.kiln.rms_norm_functional(x, weight, eps=1e-6, weight_offset=0.0) -> y
    torch.ops.kiln.add_rms_norm_functional(x, residual, weight, eps=1e-6, weight_offset=0.0)
        -> (y, s): s = x + residual (a new tensor; the inputs are left alone), y = rms_norm(s)
Backward: Triton kernels (norm_backward_triton.py) on CUDA / KILN_BACKEND=triton, plain torch else.
"""

from __future__ import annotations

import torch

from kiln.ops.autograd.dispatch import use_triton
from kiln.ops.autograd.norm_backward_triton import layer_norm_backward_triton, rms_norm_backward_triton
from kiln.ops.norm.rms_norm import rms_norm
from kiln.ops.testing import compute_dtype


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(dim=0)


def rms_norm_backward_torch(x, weight, grad_y, eps, weight_offset=0.0, grad_sum=None):
    """Plain-torch twin of rms_norm_backward_triton (math in float32, float64 for float64)."""
    xf = x.to(compute_dtype(x.dtype))
    g = grad_y.to(xf.dtype)
    w = weight.to(xf.dtype) + weight_offset
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    gw = g * w
    grad_x = inv_rms * (gw - xf * inv_rms.pow(2) * (gw * xf).mean(dim=-1, keepdim=True))
    if grad_sum is not None:
        grad_x = grad_x + grad_sum.to(xf.dtype)
    return grad_x.to(x.dtype), _sum_rows(g * xf * inv_rms).to(weight.dtype)


def layer_norm_backward_torch(x, weight, bias, grad_y, eps):
    """Plain-torch twin of layer_norm_backward_triton."""
    xf = x.to(compute_dtype(x.dtype))
    g = grad_y.to(xf.dtype)
    centered = xf - xf.mean(dim=-1, keepdim=True)
    inv_std = torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + eps)
    xhat = centered * inv_std
    gw = g * weight.to(xf.dtype)
    grad_x = inv_std * (gw - gw.mean(dim=-1, keepdim=True) - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
    grad_bias = _sum_rows(g).to(bias.dtype) if bias is not None else None
    return grad_x.to(x.dtype), _sum_rows(g * xhat).to(weight.dtype), grad_bias


# The backwards are custom ops of their own (with fakes), so torch.compile traces each as one node
# instead of tracing into a Triton launch with fake tensors.
@torch.library.custom_op("kiln::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    grad_y: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    grad_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) of y = rms_norm(x, weight, eps, weight_offset=...), plus grad_sum (the
    fused-residual variant's gradient of x + residual) added to grad_x; Triton or torch."""
    fn = rms_norm_backward_triton if use_triton(x) else rms_norm_backward_torch
    return fn(x, weight, grad_y, eps, weight_offset, grad_sum)


@rms_norm_backward.register_fake
def _(x, weight, grad_y, eps, weight_offset=0.0, grad_sum=None):
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.custom_op("kiln::layer_norm_backward", mutates_args=())
def layer_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad_y: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of y = layer_norm(x, weight, bias, eps); grad_bias is empty
    ([0]) without a bias (a custom op returns no optional tensors)."""
    fn = layer_norm_backward_triton if use_triton(x) else layer_norm_backward_torch
    grad_x, grad_weight, grad_bias = fn(x, weight, bias, grad_y, eps)
    return grad_x, grad_weight, grad_bias if grad_bias is not None else weight.new_empty((0,))


@layer_norm_backward.register_fake
def _(x, weight, bias, grad_y, eps):
    return (
        torch.empty_like(x),
        torch.empty_like(weight),
        torch.empty_like(bias) if bias is not None else weight.new_empty((0,)),
    )


# ---- layer_norm: the existing custom op ---------------------------------------------------------


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps = eps


def _layer_norm_grad(ctx, grad_y):
    x, weight, bias = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = torch.ops.kiln.layer_norm_backward(x, weight, bias, grad_y, ctx.eps)
    return grad_x, grad_weight, grad_bias if bias is not None else None, None


torch.library.register_autograd("kiln::layer_norm", _layer_norm_grad, setup_context=_layer_norm_setup)


# ---- rms_norm: functional custom ops ------------------------------------------------------------


@torch.library.custom_op("kiln::rms_norm_functional", mutates_args=())
def rms_norm_functional(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, weight_offset: float = 0.0
) -> torch.Tensor:
    """y = rms_norm(x, weight, eps, weight_offset=weight_offset), differentiable in x and weight."""
    return rms_norm(x, weight, eps, None, weight_offset)


@rms_norm_functional.register_fake
def _(x, weight, eps=1e-6, weight_offset=0.0):
    return torch.empty_like(x)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, eps, weight_offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.weight_offset = eps, weight_offset


def _rms_norm_grad(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x, grad_weight = torch.ops.kiln.rms_norm_backward(x, weight, grad_y, ctx.eps, ctx.weight_offset)
    return grad_x, grad_weight, None, None


rms_norm_functional.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


@torch.library.custom_op("kiln::add_rms_norm_functional", mutates_args=())
def add_rms_norm_functional(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s): s = x + residual, y = rms_norm(s); the fused-residual kernel on a copy of residual."""
    residual_sum = residual.clone()
    y, residual_sum = rms_norm(x, weight, eps, residual_sum, weight_offset)
    return y, residual_sum


@add_rms_norm_functional.register_fake
def _(x, residual, weight, eps=1e-6, weight_offset=0.0):
    return torch.empty_like(x), torch.empty_like(x)


def _add_rms_norm_setup(ctx, inputs, output) -> None:
    _, _, weight, eps, weight_offset = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps, ctx.weight_offset = eps, weight_offset


def _add_rms_norm_grad(ctx, grad_y, grad_sum):
    residual_sum, weight = ctx.saved_tensors
    grad_s, grad_weight = torch.ops.kiln.rms_norm_backward(
        residual_sum, weight, grad_y, ctx.eps, ctx.weight_offset, grad_sum=grad_sum
    )
    return grad_s, grad_s, grad_weight, None, None


add_rms_norm_functional.register_autograd(_add_rms_norm_grad, setup_context=_add_rms_norm_setup)
