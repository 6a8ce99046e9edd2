"""Autograd for torch.ops.kiln.fused_linear_cross_entropy.

The op returns (loss, grad_hidden, grad_weight, grad_bias): its gradients are computed in the forward
pass, chunk by chunk, so the logits are never kept for a backward. The backward only scales them by
the incoming gradient of the loss (a scalar); the three gradient outputs themselves are not
differentiable (their incoming gradients are ignored: use the loss).
"""

from __future__ import annotations

import torch


def _setup(ctx, inputs, output) -> None:
    _, grad_hidden, grad_weight, grad_bias = output
    ctx.has_bias = inputs[3] is not None
    ctx.computed_grads = len(inputs) < 9 or bool(inputs[8])
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)


def _fused_linear_cross_entropy_grad(ctx, grad_loss, *unused_output_grads):
    if not ctx.computed_grads:
        raise RuntimeError(
            "fused_linear_cross_entropy: called with compute_grads=False, so it has no gradients to give; "
            "call it with compute_grads=True (kiln.ops.autograd.fused_linear_cross_entropy_loss decides)"
        )
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    scale = grad_loss.to(torch.float32 if grad_hidden.dtype != torch.float64 else torch.float64)
    # One multiply each, in the gradients' dtypes; a grad_loss of 1 (the usual .backward()) is exact.
    grad_hidden = (grad_hidden * scale).to(grad_hidden.dtype)
    grad_weight = (grad_weight * scale).to(grad_weight.dtype)
    grad_bias = (grad_bias * scale).to(grad_bias.dtype) if ctx.has_bias else None
    return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None


torch.library.register_autograd(
    "kiln::fused_linear_cross_entropy", _fused_linear_cross_entropy_grad, setup_context=_setup
)
