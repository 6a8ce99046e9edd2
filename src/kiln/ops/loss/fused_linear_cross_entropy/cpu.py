"""CPU path of fused_linear_cross_entropy: the shared chunk loop (chunked.py) with float32 GEMMs
(float64 for float64 inputs, so gradcheck applies) and the row math in a few in-place torch ops."""

from __future__ import annotations

import torch

from kiln.ops.loss.fused_linear_cross_entropy.chunked import accumulation_dtype, chunked_loss_and_grads
from kiln.ops.loss.fused_linear_cross_entropy.spec import FUSED_LINEAR_CROSS_ENTROPY
from kiln.ops.registry import Implementation, cpu_only


def cross_entropy_rows_torch(logits, labels, row_loss, scale, ignore_index, label_smoothing, z_loss):
    """Row losses into row_loss, scale * d loss / d logits over logits (in place); see chunked.RowsFn."""
    vocab = logits.shape[-1]
    valid = labels != ignore_index
    targets = torch.where(valid, labels, 0).long()[:, None]  # ignored rows read column 0, then drop it
    lse = logits.logsumexp(dim=-1)
    target_logit = logits.gather(1, targets)[:, 0]
    mean_logit = logits.mean(dim=-1) if label_smoothing else None
    probs = logits.sub_(lse[:, None]).exp_()  # in place: the logits become the gradient from here on
    # When the model is confident (p_y -> 1), lse - z_y and p_y - 1 both cancel in float32. The
    # other probabilities' sum keeps its precision: -log p_y = -log1p(-others), p_y - 1 = -others.
    probs.scatter_(1, targets, 0.0)
    others = probs.sum(dim=-1)
    nll = torch.where(others < 0.5, -torch.log1p(-others), lse - target_logit)
    loss = (1.0 - label_smoothing) * nll
    if label_smoothing:
        loss += label_smoothing * (lse - mean_logit)
    if z_loss:
        loss += z_loss * lse * lse
    row_loss.copy_(torch.where(valid, loss, 0.0))
    # d loss_t / d z = softmax(z) * (1 + 2 z_loss lse) - (1 - eps) onehot(y) - eps / V
    row_scale = torch.where(valid, scale, 0.0).to(logits.dtype)
    softmax_scale = row_scale * (1.0 + 2.0 * z_loss * lse)
    probs.mul_(softmax_scale[:, None])
    if label_smoothing:
        probs.sub_((row_scale * (label_smoothing / vocab))[:, None])
    target_grad = (softmax_scale - (1.0 - label_smoothing) * row_scale) - softmax_scale * others
    probs.scatter_add_(1, targets, target_grad[:, None])


def fused_linear_cross_entropy_cpu(
    hidden,
    weight,
    labels,
    bias=None,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    reduction="mean",
    compute_grads=True,
    config: dict | None = None,
):
    return chunked_loss_and_grads(
        hidden,
        weight,
        labels,
        bias,
        ignore_index,
        label_smoothing,
        z_loss,
        reduction,
        cross_entropy_rows_torch,
        gemm_dtype=accumulation_dtype(hidden.dtype),
        chunk_tokens=(config or {}).get("chunk_tokens"),
        compute_grads=compute_grads,
    )


FUSED_LINEAR_CROSS_ENTROPY.register(Implementation("cpu", fused_linear_cross_entropy_cpu, cpu_only))
