"""The differentiable entry points: each calls the custom op (torch.ops.kiln.*) that carries the
autograd formula, so eager autograd, torch.compile and the plain kiln.ops functions' kernels all
meet in one place. The kiln.ops.<op> functions themselves call the kernels directly (the engine's
inference path, no autograd bookkeeping) and are not differentiable.
"""

from __future__ import annotations

import torch

from kiln.ops.loss.fused_linear_cross_entropy.spec import FUSED_LINEAR_CROSS_ENTROPY
from kiln.ops.norm.rms_norm.spec import RMS_NORM
from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
):
    """RMSNorm of x [..., hidden] (see kiln.ops.rms_norm), differentiable in x, weight (and residual).
    Returns y; with `residual`, (y, x + residual) as a new tensor (residual is NOT written in place)."""
    RMS_NORM.check(x, weight, eps, residual, weight_offset)
    if residual is None:
        return torch.ops.kiln.rms_norm_functional(x, weight, eps, weight_offset)
    return torch.ops.kiln.add_rms_norm_functional(x, residual, weight, eps, weight_offset)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5):
    """LayerNorm of x [..., hidden] (see kiln.ops.layer_norm), differentiable in x, weight, bias."""
    return torch.ops.kiln.layer_norm(x, weight, bias, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d], differentiable."""
    return torch.ops.kiln.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[..., :d]) * x[..., d:] for x [..., 2d], differentiable."""
    return torch.ops.kiln.gelu_tanh_and_mul(x)


def softmax(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(x / temperature) over the last dim, differentiable in x."""
    return torch.ops.kiln.softmax(x, temperature)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) [T, H, D] rotated by the angles of positions [T] (see kiln.ops.rotary_embedding), as new
    tensors (out of place, unlike kiln.ops.rotary_embedding), differentiable in q and k."""
    ROTARY_EMBEDDING.check(positions, q, k, cos_sin_cache, is_neox)
    return torch.ops.kiln.rotary_embedding_functional(positions, q, k, cos_sin_cache, is_neox)


def fused_linear_cross_entropy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """The cross-entropy of (hidden [T, H] @ weight [V, H]^T + bias) against labels [T], as a float32
    scalar, differentiable in hidden, weight and bias; the [T, V] logits are never materialized (see
    kiln.ops.fused_linear_cross_entropy for the math). Hidden states of any leading shape are
    flattened to rows with the labels. Under torch.autocast the GEMMs run in autocast's dtype, as the
    LM head's linear would (hidden, weight and bias cast to it; their gradients come back in theirs)."""
    if hidden.dim() > 2:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    # nothing to differentiate (evaluation under no_grad, a frozen head and hidden states): the loss
    # alone, without the gradient GEMMs (5x the time of an unfused loss on the CPU otherwise)
    leaves = (hidden, weight) if bias is None else (hidden, weight, bias)
    compute_grads = torch.is_grad_enabled() and any(t.requires_grad for t in leaves)
    args = (hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction, compute_grads)
    FUSED_LINEAR_CROSS_ENTROPY.check(*args)
    return torch.ops.kiln.fused_linear_cross_entropy(*args)[0]


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention (see kiln.ops.flash_attention: q [total_q, H, D], k/v [total_k, Hkv, D], int32
    cu_seqlens), differentiable in q, k and v: out [total_q, H, D], or with return_lse (out, lse
    float32 [H, total_q]), the LSE differentiable too. Runs flash_attention_with_lse, whose saved LSE
    the backward (kiln.ops.flash_attention_backward) recomputes the probabilities from. The custom op
    validates the arguments itself (its fake too, under torch.compile)."""
    options = (causal, scale, sliding_window, softcap)
    out, lse = torch.ops.kiln.flash_attention_with_lse(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options
    )
    return (out, lse) if return_lse else out
