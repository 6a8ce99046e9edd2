"""Autograd for torch.ops.kiln.softmax(x, temperature): the backward reads the saved output
(grad_x = y (grad_y - sum(grad_y y)) / T), Triton on CUDA / KILN_BACKEND=triton, plain torch else.

The forward's output is rounded to x's dtype; the backward uses that rounded y (as torch's own
softmax backward does), so half-precision gradients carry one extra rounding of y.
"""

from __future__ import annotations

import torch

from kiln.ops.autograd.dispatch import use_triton
from kiln.ops.autograd.softmax_backward_triton import softmax_backward_triton
from kiln.ops.testing import compute_dtype


def softmax_backward_torch(y: torch.Tensor, grad_y: torch.Tensor, temperature: float) -> torch.Tensor:
    yf = y.to(compute_dtype(y.dtype))
    g = grad_y.to(yf.dtype)
    return (yf * (g - (g * yf).sum(dim=-1, keepdim=True)) / temperature).to(y.dtype)


@torch.library.custom_op("kiln::softmax_backward", mutates_args=())
def softmax_backward(y: torch.Tensor, grad_y: torch.Tensor, temperature: float) -> torch.Tensor:
    """grad_x of y = softmax(x / temperature), from y and grad_y (a custom op: one node to compilers)."""
    fn = softmax_backward_triton if use_triton(y) else softmax_backward_torch
    return fn(y, grad_y, temperature)


@softmax_backward.register_fake
def _(y, grad_y, temperature):
    return torch.empty_like(y)


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output)
    ctx.temperature = inputs[1]


def _softmax_grad(ctx, grad_y):
    (y,) = ctx.saved_tensors
    return torch.ops.kiln.softmax_backward(y, grad_y, ctx.temperature), None


torch.library.register_autograd("kiln::softmax", _softmax_grad, setup_context=_setup)
