"""fused_linear_cross_entropy in jax (XLA): chunked.py's loop as a jax.lax.scan over chunks of tokens,
so only one [chunk, V] block of logits exists at a time. Per chunk: logits = h @ W^T (+ b) with float32
accumulation, rounded once to the inputs' dtype (as the torch backends); the row losses and
d loss / d logits in float32 (spec.py's formula); then grad_hidden = dz @ W and the float32
accumulators of grad_weight += dz^T @ h and grad_bias += sum(dz). T is padded to whole chunks with
ignored rows (they add nothing). The loss is float32 (JAX has no float64 unless jax_enable_x64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.ops.loss.fused_linear_cross_entropy.spec import FUSED_LINEAR_CROSS_ENTROPY
from kiln.ops.pallas_common import pad_to, round_up

HIGHEST = jax.lax.Precision.HIGHEST


def chunk_tokens_for(tokens: int, hidden_size: int, vocab: int) -> int:
    """Tokens per chunk: a power of two whose [chunk, V] logits are about the size of [T, H]."""
    chunks = -(-vocab // max(hidden_size, 1))
    per_chunk = -(-tokens // chunks)
    return 1 << max(0, (per_chunk - 1).bit_length())


def rows_loss_and_grad(logits, labels, scale, ignore_index, label_smoothing, z_loss):
    """float32 logits [C, V], labels [C] -> (row losses [C], scale * d loss / d logits [C, V])."""
    vocab = logits.shape[-1]
    valid = labels != ignore_index
    target = jnp.where(valid, labels, 0).astype(jnp.int32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    z_y = jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0]
    probs = jnp.exp(logits - lse[:, None])
    one_hot = jnp.arange(vocab)[None, :] == target[:, None]
    # When the model is confident (p_y -> 1), lse - z_y and p_y - 1 both cancel in float32; the sum
    # of the other probabilities keeps its precision: -log p_y = -log1p(-others), p_y - 1 = -others.
    others = jnp.sum(jnp.where(one_hot, 0.0, probs), axis=-1, keepdims=True)
    nll = jnp.where(others[:, 0] < 0.5, -jnp.log1p(-others[:, 0]), lse - z_y)
    loss = (1.0 - label_smoothing) * nll + label_smoothing * (lse - jnp.mean(logits, axis=-1))
    loss = loss + z_loss * lse * lse
    row_scale = jnp.where(valid, scale, 0.0)
    softmax_scale = (1.0 + 2.0 * z_loss * lse)[:, None]
    target_grad = (softmax_scale - (1.0 - label_smoothing)) - softmax_scale * others - label_smoothing / vocab
    grad = jnp.where(one_hot, target_grad, probs * softmax_scale - label_smoothing / vocab)
    return jnp.where(valid, loss, 0.0), grad * row_scale[:, None]


def fused_linear_cross_entropy_xla(
    hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean",
    compute_grads=True,
):  # fmt: skip
    result = _loss_and_grads(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction)
    return result if compute_grads else loss_only(result, hidden, weight)


def loss_only(result, hidden, weight):
    """compute_grads=False on the JAX backends: the loss and empty gradients (the gradients are
    still computed, then dropped: XLA may prune them under jit, eager JAX does not)."""
    empty = jnp.zeros((0,), hidden.dtype)
    return result[0], empty, jnp.zeros((0,), weight.dtype), empty


def _loss_and_grads(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction):
    tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    chunk = chunk_tokens_for(tokens, hidden_size, vocab)
    padded = round_up(tokens, chunk)
    h_chunks = pad_to(hidden, 0, padded).reshape(-1, chunk, hidden_size)
    label_chunks = jnp.pad(labels, (0, padded - tokens), constant_values=ignore_index).reshape(-1, chunk)
    num_valid = jnp.sum(labels != ignore_index).astype(jnp.float32)
    scale = 1.0 / num_valid if reduction == "mean" else jnp.float32(1.0)
    w32 = weight.astype(jnp.float32)

    def step(carry, chunk_inputs):
        loss_sum, grad_w, grad_b = carry
        h, lab = chunk_inputs
        logits = jnp.dot(h, weight.T, precision=HIGHEST, preferred_element_type=jnp.float32)
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        logits = logits.astype(hidden.dtype).astype(jnp.float32)  # one rounding, as the torch backends
        rows, dz = rows_loss_and_grad(logits, lab, scale, ignore_index, label_smoothing, z_loss)
        grad_h = jnp.dot(dz, w32, precision=HIGHEST).astype(hidden.dtype)
        grad_w = grad_w + jnp.dot(dz.T, h.astype(jnp.float32), precision=HIGHEST)
        return (loss_sum + jnp.sum(rows), grad_w, grad_b + jnp.sum(dz, axis=0)), grad_h

    init = (jnp.float32(0.0), jnp.zeros((vocab, hidden_size), jnp.float32), jnp.zeros((vocab,), jnp.float32))
    (loss_sum, grad_w, grad_b), grad_h = jax.lax.scan(step, init, (h_chunks, label_chunks))
    loss = loss_sum * scale
    grad_bias = grad_b.astype(bias.dtype) if bias is not None else jnp.zeros((0,), hidden.dtype)
    return loss, grad_h.reshape(padded, hidden_size)[:tokens], grad_w.astype(weight.dtype), grad_bias


FUSED_LINEAR_CROSS_ENTROPY.register_jax("xla", fused_linear_cross_entropy_xla)
