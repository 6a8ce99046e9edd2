"""The chunk loop both backends share: per chunk of tokens, the logits GEMM, the row kernel (loss and
d loss / d logits, written over the logits), then the two gradient GEMMs. Only the row kernel and the
dtype of the GEMMs differ between backends.

Peak memory beyond the inputs and the gradients: one [chunk, V] logits buffer (plus a float32
[V, H] accumulator for grad_weight when the inputs are half precision). The chunk is sized so that
buffer holds about as many elements as `hidden` (Liger-Kernel's rule): ceil(V / H) chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from kiln.ops.alloc import empty, empty_like

# rows_fn(logits [C, V], labels [C], row_loss [C] out, scale 0-d tensor, ignore_index, label_smoothing,
# z_loss): writes each row's unscaled loss (0 for an ignored row) into row_loss and replaces logits
# with scale * d loss_row / d logits (zeros for an ignored row).
RowsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, float], None]


def chunk_tokens_for(tokens: int, hidden_size: int, vocab: int) -> int:
    """Tokens per chunk: a power of two whose [chunk, V] logits are about the size of [T, H]."""
    chunks = -(-vocab // max(hidden_size, 1))
    return max(1, triton.next_power_of_2(-(-tokens // chunks)))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunked_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    reduction: str,
    rows_fn: RowsFn,
    gemm_dtype: torch.dtype,
    chunk_tokens: int | None = None,
    compute_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias) as the op returns them (see spec.py). Computed in
    the inputs' dtypes whatever autocast says around the call (kiln.ops.autograd's entry point casts
    the inputs as autocast would first)."""
    with torch.autocast(hidden.device.type, enabled=False):
        # labels contiguous: the Triton row kernel reads them at unit stride
        return _chunked(
            hidden, weight, labels.contiguous(), bias, ignore_index, label_smoothing, z_loss, reduction,
            rows_fn, gemm_dtype, chunk_tokens, compute_grads,
        )  # fmt: skip


def _chunked(
    hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction, rows_fn, gemm_dtype,
    chunk_tokens, compute_grads,
):  # fmt: skip
    tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = accumulation_dtype(hidden.dtype)
    chunk = chunk_tokens or chunk_tokens_for(tokens, hidden_size, vocab)
    w = weight.to(gemm_dtype)
    b = bias.to(gemm_dtype) if bias is not None else None

    num_valid = (labels != ignore_index).sum().to(acc_dtype)
    # Mean: every row's gradient is divided by the number of valid tokens, known before any chunk
    # runs (a device tensor, so no sync): the gradients come out final, no second pass.
    scale = 1.0 / num_valid if reduction == "mean" else torch.ones((), dtype=acc_dtype, device=hidden.device)

    row_loss = empty((tokens,), acc_dtype, hidden.device)
    if compute_grads:
        grad_hidden = empty_like(hidden)
        # Half inputs: grad_weight sums T / chunk partial GEMMs; accumulate them in float32.
        grad_weight = torch.zeros((vocab, hidden_size), dtype=acc_dtype, device=hidden.device)
        grad_bias = torch.zeros((vocab,), dtype=acc_dtype, device=hidden.device) if bias is not None else None

    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        h = hidden[start:end].to(gemm_dtype)
        logits = h @ w.T if b is None else torch.addmm(b, h, w.T)
        # (without compute_grads the row kernel still writes d loss / d logits, which nobody reads)
        rows_fn(logits, labels[start:end], row_loss[start:end], scale, ignore_index, label_smoothing, z_loss)
        if not compute_grads:
            continue
        grad_hidden[start:end] = logits @ w
        if gemm_dtype == acc_dtype:
            grad_weight.addmm_(logits.T, h)
        else:
            grad_weight += (logits.T @ h).to(acc_dtype)
        if grad_bias is not None:
            grad_bias += logits.sum(dim=0, dtype=acc_dtype)

    loss = row_loss.sum() * scale
    if not compute_grads:
        empty_grad = hidden.new_empty((0,))
        return loss, empty_grad, weight.new_empty((0,)), empty_grad
    grad_bias_out = grad_bias.to(bias.dtype) if bias is not None else hidden.new_empty((0,))
    return loss, grad_hidden, grad_weight.to(weight.dtype), grad_bias_out
