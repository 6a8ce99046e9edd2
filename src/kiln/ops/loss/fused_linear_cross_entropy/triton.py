"""Triton row kernel of fused_linear_cross_entropy; the GEMMs around it are torch.matmul in the
inputs' dtype (cuBLAS on a GPU), one chunk of tokens at a time (chunked.py).

One program owns one row of a chunk's logits. Pass 1 walks the vocabulary in BLOCK_V columns with
the online softmax (per lane: running max m, sum d of exp(x - m), rescaled when m grows), plus the
row sum of x for label smoothing; the lanes merge into the row's logsumexp. Pass 2 walks it again
and overwrites the logits with scale * d loss / d logits, so the gradient needs no buffer of its
own. The target logit is read before pass 2 writes over it; its gradient is written last, from the
sum of the other probabilities (p_y - 1 would cancel when p_y is near 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.loss.fused_linear_cross_entropy.chunked import chunked_loss_and_grads
from kiln.ops.loss.fused_linear_cross_entropy.spec import FUSED_LINEAR_CROSS_ENTROPY
from kiln.ops.registry import Implementation, triton_available

MAX_BLOCK_V = 4096


@triton.jit
def _log1p(x):
    """log(1 + x) for |x| <= 1/2 without losing small x to the rounding of 1 + x (Goldberg's trick)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * x / (u - 1.0))


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    row_loss_ptr,
    scale_ptr,
    vocab,
    ignore_index,
    label_smoothing,
    z_loss,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    if label == ignore_index:
        for start in range(0, vocab, BLOCK_V):
            c = start + cols
            tl.store(
                logits_row + c,
                tl.zeros((BLOCK_V,), tl.float32).to(logits_ptr.dtype.element_ty),
                mask=c < vocab,
            )
        tl.store(row_loss_ptr + row, 0.0)
        return

    target_logit = tl.load(logits_row + label).to(tl.float32)
    m = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float32)
    d = tl.zeros((BLOCK_V,), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        c = start + cols
        mask = c < vocab
        x = tl.load(logits_row + c, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # A lane past the end of a short row sees only -inf: shift by 0 there, not -inf (NaN).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
        row_sum += tl.where(mask, x, 0.0)
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(d * tl.exp(m - row_max), axis=0))

    scale = tl.load(scale_ptr).to(tl.float32)
    softmax_scale = scale * (1.0 + 2.0 * z_loss * lse)
    uniform = scale * label_smoothing / vocab
    others = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        c = start + cols
        mask = (c < vocab) & (c != label)
        x = tl.load(logits_row + c, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - lse)
        others += p
        tl.store(logits_row + c, (p * softmax_scale - uniform).to(logits_ptr.dtype.element_ty), mask=mask)
    # When the model is confident (p_y -> 1), lse - z_y and p_y - 1 both cancel in float32; the sum
    # of the other probabilities keeps its precision: -log p_y = -log1p(-others), p_y - 1 = -others.
    others_sum = tl.sum(others, axis=0)
    target_grad = softmax_scale - scale * (1.0 - label_smoothing) - uniform - softmax_scale * others_sum
    tl.store(logits_row + label, target_grad.to(logits_ptr.dtype.element_ty))
    nll = tl.where(others_sum < 0.5, -_log1p(-others_sum), lse - target_logit)
    loss = (1.0 - label_smoothing) * nll + label_smoothing * (lse - tl.sum(row_sum, axis=0) / vocab)
    loss += z_loss * lse * lse
    tl.store(row_loss_ptr + row, loss)


def cross_entropy_rows_triton(logits, labels, row_loss, scale, ignore_index, label_smoothing, z_loss):
    """The row kernel over a chunk; see chunked.RowsFn. logits: [C, V] with a unit column stride."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    _cross_entropy_rows_kernel[(rows,)](
        logits,
        logits.stride(0),
        labels,
        row_loss,
        scale,
        vocab,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        BLOCK_V=block_v,
        num_warps=min(max(block_v // 256, 1), 16),
    )


def fused_linear_cross_entropy_triton(
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
    # float64 (gradcheck) keeps float64 GEMMs; everything else runs its GEMMs in the input dtype.
    return chunked_loss_and_grads(
        hidden,
        weight,
        labels,
        bias,
        ignore_index,
        label_smoothing,
        z_loss,
        reduction,
        cross_entropy_rows_triton,
        gemm_dtype=hidden.dtype,
        chunk_tokens=(config or {}).get("chunk_tokens"),
        compute_grads=compute_grads,
    )


FUSED_LINEAR_CROSS_ENTROPY.register(
    Implementation("triton", fused_linear_cross_entropy_triton, triton_available)
)
