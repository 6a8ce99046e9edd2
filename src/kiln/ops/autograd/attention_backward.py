"""Autograd for torch.ops.kiln.flash_attention_with_lse: the forward saves q, k, v, out and the LSE;
the backward is the op torch.ops.kiln.flash_attention_backward (Triton on CUDA / KILN_BACKEND=triton,
the CPU path else; see kiln.ops.attention.flash_attention_backward), which recomputes the attention
probabilities from the LSE. Gradients of both outputs flow: the LSE's enters as grad_lse.

torch.ops.kiln.flash_attention (out only) has no backward: it keeps no LSE to recompute from.
Training calls kiln.ops.autograd.flash_attention, which runs the _with_lse op.
"""

from __future__ import annotations

import torch


def _setup(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.options = (max_seqlen_q, max_seqlen_k, causal, scale, window, softcap)


def _flash_attention_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.kiln.flash_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, grad_lse
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("kiln::flash_attention_with_lse", _flash_attention_grad, setup_context=_setup)
