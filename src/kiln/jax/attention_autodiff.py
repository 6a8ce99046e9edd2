"""Differentiable attention for kiln.jax.flash_attention: a jax.custom_vjp around the padded-batch
forward kernels. Behind the Pallas TPU forward the backward is the Pallas TPU kernel pair of
kiln.ops.attention.flash_attention_backward.pallas_tpu, recomputing the probabilities from the
forward's saved LSE; behind the others (pallas_gpu, xla) it is XLA's autodiff of the XLA forward
(the TPU kernels would run in the TPU interpreter off a TPU: 0.19 s against 1.7 ms for a
[1, 256, 4, 64] backward on a CPU). jax.grad never traces into a pallas_call.

Residuals kept from the forward: q, k, v, out and lse (float32 [B, H, Sq]); nothing of size
[Sq, Sk]. Gradients flow to q, k and v from out and from lse (when the caller differentiates the
returned lse); q_lens/kv_lens get none. causal, scale, sliding_window, softcap and the forward
kernel are static.
"""

from __future__ import annotations

import functools

import jax

from kiln.ops.attention.flash_attention.pallas_tpu import flash_attention_padded_pallas_tpu
from kiln.ops.attention.flash_attention.xla import flash_attention_padded_xla
from kiln.ops.attention.flash_attention_backward.pallas_tpu import flash_attention_backward_padded_pallas_tpu


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def attend(q, k, v, q_lens, kv_lens, kernel, causal, scale, sliding_window, softcap):
    """(out [B, Sq, H, D], lse float32 [B, H, Sq]) of `kernel` (a padded-batch forward of
    kiln.ops.attention.flash_attention), differentiable in q, k and v."""
    return kernel(q, k, v, q_lens, kv_lens, causal, scale, sliding_window, softcap)


def _attend_fwd(q, k, v, q_lens, kv_lens, kernel, causal, scale, sliding_window, softcap):
    out, lse = attend(q, k, v, q_lens, kv_lens, kernel, causal, scale, sliding_window, softcap)
    return (out, lse), (q, k, v, out, lse, q_lens, kv_lens)


def _attend_bwd(kernel, causal, scale, sliding_window, softcap, saved, grads):
    q, k, v, out, lse, q_lens, kv_lens = saved
    grad_out, grad_lse = grads
    if kernel is not flash_attention_padded_pallas_tpu:

        def forward(q, k, v):
            options = (causal, scale, sliding_window, softcap)
            return flash_attention_padded_xla(q, k, v, q_lens, kv_lens, *options)

        _, vjp = jax.vjp(forward, q, k, v)
        return (*vjp((grad_out.astype(q.dtype), grad_lse)), None, None)
    dq, dk, dv = flash_attention_backward_padded_pallas_tpu(
        grad_out.astype(q.dtype), q, k, v, out, lse, q_lens, kv_lens, causal, scale, sliding_window,
        softcap, grad_lse,
    )  # fmt: skip
    return dq, dk, dv, None, None


attend.defvjp(_attend_fwd, _attend_bwd)
