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
    loss = lse - (1.0 - label_smoothing) * logits.gather(1, targets)[:, 0]
    if label_smoothing:
        loss -= label_smoothing * logits.mean(dim=-1)
    if z_loss:
        loss += z_loss * lse * lse
    row_loss.copy_(torch.where(valid, loss, 0.0))
    # d loss_t / d z = softmax(z) * (1 + 2 z_loss lse) - (1 - eps) onehot(y) - eps / V
    row_scale = torch.where(valid, scale, 0.0).to(logits.dtype)
    logits.sub_(lse[:, None]).exp_().mul_((row_scale * (1.0 + 2.0 * z_loss * lse))[:, None])
    if label_smoothing:
        logits.sub_((row_scale * (label_smoothing / vocab))[:, None])
    logits.scatter_add_(1, targets, -(1.0 - label_smoothing) * row_scale[:, None])


def fused_linear_cross_entropy_cpu(
    hidden,
    weight,
    labels,
    bias=None,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    reduction="mean",
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
    )


FUSED_LINEAR_CROSS_ENTROPY.register(Implementation("cpu", fused_linear_cross_entropy_cpu, cpu_only))
