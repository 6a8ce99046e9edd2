"""Autograd for rotary position embedding.

torch.ops.kiln.rotary_embedding rotates q and k in place, and torch.library differentiates only
functional ops, so training uses
    torch.ops.kiln.rotary_embedding_functional(positions, q, k, cos_sin_cache, is_neox=True)
        -> (q_rotated, k_rotated)   (new tensors; q and k are left alone)
The rotation is orthogonal, so its backward is the rotation by -theta: the same forward kernel
(Triton on CUDA, the CPU path otherwise) applied to the incoming gradients with sin negated. The
cos/sin rows are gathered once per backward ([T, rotary_dim], T = tokens) and the kernel is pointed
at them with positions 0..T-1.
"""

from __future__ import annotations

import torch

from kiln.ops.rope.rotary_embedding import rotary_embedding


def rotate_back(positions, grad_q, grad_k, cos_sin_cache, is_neox=True):
    """(grad_q, grad_k): grad_q [T, Hq, D] and grad_k [T, Hk, D] rotated by -theta(positions)."""
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions]
    inverse = torch.cat([rows[:, :half], -rows[:, half:]], dim=-1)
    tokens = torch.arange(positions.shape[0], device=positions.device, dtype=positions.dtype)
    q = grad_q.clone(memory_format=torch.contiguous_format)  # rotated in place: never the caller's
    k = grad_k.clone(memory_format=torch.contiguous_format)
    torch.ops.kiln.rotary_embedding(tokens, q, k, inverse, is_neox)  # the custom op: compilers see one node
    return q, k


@torch.library.custom_op("kiln::rotary_embedding_functional", mutates_args=())
def rotary_embedding_functional(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by the angles of `positions` (see kiln.ops.rotary_embedding), out of place."""
    q = q.clone(memory_format=torch.contiguous_format)
    k = k.clone(memory_format=torch.contiguous_format)
    return rotary_embedding(positions, q, k, cos_sin_cache, is_neox)


@rotary_embedding_functional.register_fake
def _(positions, q, k, cos_sin_cache, is_neox=True):
    return torch.empty_like(q), torch.empty_like(k)


def _setup(ctx, inputs, output) -> None:
    positions, _, _, cos_sin_cache, is_neox = inputs
    ctx.save_for_backward(positions, cos_sin_cache)
    ctx.is_neox = is_neox


def _rotary_grad(ctx, grad_q, grad_k):
    positions, cos_sin_cache = ctx.saved_tensors
    grad_q, grad_k = rotate_back(positions, grad_q, grad_k, cos_sin_cache, ctx.is_neox)
    return None, grad_q, grad_k, None, None


rotary_embedding_functional.register_autograd(_rotary_grad, setup_context=_setup)
