"""fused_linear_cross_entropy as Pallas Triton (GPU) kernels (the Pallas interpreter off a GPU).

The chunk loop is xla.py's: a lax.scan over chunks of C tokens. Per chunk, one row kernel with grid
(token tiles of block_t rows): a program walks the vocabulary in blocks of block_v words, twice, and
computes each [block_t, block_v] block of logits itself (h_tile @ W_block^T, a fori_loop over block_h
slices of the hidden size, float32 accumulation, + bias, rounded once to the inputs' dtype as every
backend does), so no logits buffer exists:

  pass 0 keeps, per row, the running max m, the sums of exp(z - m) over all words (d) and over the
    words other than the label (d_others), both rescaled when m grows (online softmax), the target
    logit z_y and (label smoothing) the row sum of z;
  pass 1 computes the same logits again and writes scale * d loss / d logits over the chunk's
    [C, V] gradient block by block, then the row losses.

others = d_others / d is the sum of the OTHER probabilities, which keeps float32's precision when the
model is confident (p_y -> 1, where lse - z_y and p_y - 1 cancel): -log p_y = -log1p(-others) when
others < 0.5, else lse - z_y, and the target's gradient uses 1 - p_y = others (the same numerics as
the cpu, triton, xla and pallas_tpu backends). Then grad_hidden = dz @ W and grad_weight += dz^T @ h
(float32) are linear's Pallas Triton GEMM (kiln.ops.gemm.linear.pallas_gpu), grad_bias += sum(dz).

Blocks are powers of two of at least 16 (tl.dot): the vocabulary is padded with zero weight rows
whose logits are masked to -inf (probability 0, gradient 0), the hidden size with zero columns, the
chunk to whole tiles with ignored rows (label -1: loss 0, zero gradient). The loss is float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.linear.pallas_gpu import gemm_gpu
from kiln.ops.loss.fused_linear_cross_entropy.spec import FUSED_LINEAR_CROSS_ENTROPY
from kiln.ops.loss.fused_linear_cross_entropy.xla import HIGHEST, chunk_tokens_for, loss_only
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up

MIN_DOT = 16  # Triton's smallest tl.dot dimension: rows, vocabulary and hidden blocks are at least this
MAX_BLOCK_T, MAX_BLOCK_V, MAX_BLOCK_H = 32, 128, 64


def _rows_kernel(
    scale_ref, labels_ref, h_ref, w_ref, *refs, vocab, label_smoothing, z_loss, block_v, block_h,
    has_bias,
):  # fmt: skip
    """One tile of block_t rows over the whole vocabulary: row losses and scale * d loss / d logits
    (module docstring). labels: int32, -1 on ignored rows."""
    from jax.experimental.pallas import triton as plgpu

    bias_ref, dz_ref, loss_ref = refs if has_bias else (None, *refs)
    block_t, hidden = h_ref.shape
    tile = pl.program_id(0)
    labels = labels_ref[...][:, None]  # [block_t, 1]
    valid = labels >= 0
    precision = HIGHEST if h_ref.dtype == jnp.float32 else None
    contract_last = (((1,), (1,)), ((), ()))

    def logits(j):
        """The [block_t, block_v] logits of vocabulary block j (float32, -inf past the vocabulary)
        and the vocabulary index of each column."""
        start = pl.multiple_of(j * block_v, block_v)

        def k_step(kk, acc):
            cols = pl.ds(pl.multiple_of(kk * block_h, block_h), block_h)
            h = h_ref[:, cols]
            w = plgpu.load(w_ref.at[pl.ds(start, block_v), cols])
            return acc + jax.lax.dot_general(
                h, w, contract_last, preferred_element_type=jnp.float32, precision=precision
            )

        z = jax.lax.fori_loop(0, hidden // block_h, k_step, jnp.zeros((block_t, block_v), jnp.float32))
        if has_bias:
            z = z + plgpu.load(bias_ref.at[pl.ds(start, block_v)]).astype(jnp.float32)[None, :]
        z = z.astype(h_ref.dtype).astype(jnp.float32)  # one rounding, as the other backends
        columns = start + jax.lax.broadcasted_iota(jnp.int32, (block_t, block_v), 1)
        return jnp.where(columns < vocab, z, -jnp.inf), columns

    def statistics(j, carry):
        m, d, d_others, z_y, z_sum = carry
        z, columns = logits(j)
        is_target = columns == labels
        # Block 0 holds word 0, a finite logit: m is finite from the first block on.
        m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
        rescale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new)
        d = d * rescale + jnp.sum(e, axis=1, keepdims=True)
        d_others = d_others * rescale + jnp.sum(jnp.where(is_target, 0.0, e), axis=1, keepdims=True)
        z_y = z_y + jnp.sum(jnp.where(is_target, z, 0.0), axis=1, keepdims=True)
        z_sum = z_sum + jnp.sum(jnp.where(columns < vocab, z, 0.0), axis=1, keepdims=True)
        return m_new, d, d_others, z_y, z_sum

    num_blocks = dz_ref.shape[1] // block_v
    zeros = jnp.zeros((block_t, 1), jnp.float32)
    init = (jnp.full((block_t, 1), -jnp.inf, jnp.float32), zeros, zeros, zeros, zeros)
    m, d, d_others, z_y, z_sum = jax.lax.fori_loop(0, num_blocks, statistics, init)
    lse, others = m + jnp.log(d), d_others / d
    row_scale = jnp.where(valid, scale_ref[0], 0.0)
    softmax_scale = row_scale * (1.0 + 2.0 * z_loss * lse)
    uniform = row_scale * (label_smoothing / vocab)
    # softmax_scale - row_scale first (exact without z-loss), then - others: no 1 - others rounding.
    target_grad = softmax_scale - (1.0 - label_smoothing) * row_scale - softmax_scale * others - uniform
    rows = pl.ds(pl.multiple_of(tile * block_t, block_t), block_t)

    def write_gradient(j, carry):
        z, columns = logits(j)
        grad = jnp.where(columns == labels, target_grad, jnp.exp(z - lse) * softmax_scale - uniform)
        grad = jnp.where(valid & (columns < vocab), grad, 0.0)
        plgpu.store(dz_ref.at[rows, pl.ds(pl.multiple_of(j * block_v, block_v), block_v)], grad)
        return carry

    jax.lax.fori_loop(0, num_blocks, write_gradient, 0)
    nll = jnp.where(others < 0.5, -jnp.log1p(-others), lse - z_y)
    loss = (1.0 - label_smoothing) * nll + z_loss * lse * lse
    if label_smoothing:
        loss = loss + label_smoothing * (lse - z_sum / vocab)
    loss_ref[...] = jnp.where(valid, loss, 0.0)[:, 0]


def rows_loss_and_grad_gpu(h, weight, bias, labels, scale, vocab, label_smoothing, z_loss, blocks, interpret):
    """One chunk: h [C, Hp], weight [Vp, Hp] (zero rows past `vocab`), bias [Vp] or None, labels [C]
    int32 (-1: ignored), scale float32 scalar -> (row losses [C], scale * d loss / d logits float32
    [C, Vp], zero past the vocabulary). C, Vp, Hp are multiples of `blocks` = (block_t, block_v,
    block_h)."""
    from jax.experimental.pallas import triton as plgpu

    (rows, hidden), padded_vocab = h.shape, weight.shape[0]
    block_t, block_v, block_h = blocks
    whole = pl.no_block_spec  # the weight, bias and gradient: read and written by block index
    row_vector = pl.BlockSpec((block_t,), lambda i: (i,))
    in_specs = [whole, row_vector, pl.BlockSpec((block_t, hidden), lambda i: (i, 0)), whole]
    operands = [jnp.reshape(scale, (1,)).astype(jnp.float32), labels, h, weight]
    if bias is not None:
        in_specs.append(whole)
        operands.append(bias)
    kernel = functools.partial(
        _rows_kernel, vocab=vocab, label_smoothing=label_smoothing, z_loss=z_loss, block_v=block_v,
        block_h=block_h, has_bias=bias is not None,
    )  # fmt: skip
    grad, row_loss = pl.pallas_call(
        kernel,
        grid=(rows // block_t,),
        in_specs=in_specs,
        out_specs=[whole, row_vector],
        out_shape=[
            jax.ShapeDtypeStruct((rows, padded_vocab), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(*operands)
    return row_loss, grad


def blocking(tokens: int, hidden_size: int, vocab: int) -> tuple[int, int, int, int]:
    """(chunk, block_t, block_v, block_h): tokens per chunk (xla.py's rule, at least MIN_DOT) and the
    kernel's power-of-two blocks."""
    chunk = max(chunk_tokens_for(tokens, hidden_size, vocab), MIN_DOT)
    block_v = min(MAX_BLOCK_V, max(MIN_DOT, pl.next_power_of_2(vocab)))
    block_h = min(MAX_BLOCK_H, max(MIN_DOT, pl.next_power_of_2(hidden_size)))
    return chunk, min(chunk, MAX_BLOCK_T), block_v, block_h


@functools.partial(
    jax.jit, static_argnames=("ignore_index", "label_smoothing", "z_loss", "reduction", "interpret")
)
def _flce_gpu(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction, interpret):
    tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    chunk, block_t, block_v, block_h = blocking(tokens, hidden_size, vocab)
    padded, padded_vocab, padded_hidden = (
        round_up(tokens, chunk),
        round_up(vocab, block_v),
        round_up(hidden_size, block_h),
    )
    h_chunks = pad_to(pad_to(hidden, 0, padded), 1, padded_hidden).reshape(-1, chunk, padded_hidden)
    valid = labels != ignore_index
    kernel_labels = jnp.pad(
        jnp.where(valid, labels, -1).astype(jnp.int32), (0, padded - tokens), constant_values=-1
    )
    num_valid = jnp.sum(valid).astype(jnp.float32)
    scale = 1.0 / num_valid if reduction == "mean" else jnp.float32(1.0)
    weight_p = pad_to(pad_to(weight, 0, padded_vocab), 1, padded_hidden)
    weight_t32 = weight_p.T.astype(jnp.float32)  # [Hp, Vp]: grad_hidden = dz @ W as linear's x @ w^T
    bias_p = pad_to(bias, 0, padded_vocab) if bias is not None else None
    gemm = functools.partial(
        gemm_gpu, scale=None, bias=None, silu_mul=False, blocks=None, interpret=interpret
    )

    def step(carry, chunk_inputs):
        loss_sum, grad_w, grad_b = carry
        h, lab = chunk_inputs
        rows, dz = rows_loss_and_grad_gpu(
            h, weight_p, bias_p, lab, scale, vocab, label_smoothing, z_loss, (block_t, block_v, block_h),
            interpret,
        )  # fmt: skip
        grad_h = gemm(dz, weight_t32).astype(hidden.dtype)
        grad_w = grad_w + gemm(dz.T, h.T.astype(jnp.float32))
        return (loss_sum + jnp.sum(rows), grad_w, grad_b + jnp.sum(dz, axis=0)), grad_h

    init = (
        jnp.float32(0.0),
        jnp.zeros((padded_vocab, padded_hidden), jnp.float32),
        jnp.zeros((padded_vocab,), jnp.float32),
    )
    (loss_sum, grad_w, grad_b), grad_h = jax.lax.scan(
        step, init, (h_chunks, kernel_labels.reshape(-1, chunk))
    )
    grad_h = grad_h.reshape(padded, padded_hidden)[:tokens, :hidden_size]
    grad_w = grad_w[:vocab, :hidden_size].astype(weight.dtype)
    grad_bias = grad_b[:vocab].astype(bias.dtype) if bias is not None else jnp.zeros((0,), hidden.dtype)
    return loss_sum * scale, grad_h, grad_w, grad_bias


def fused_linear_cross_entropy_pallas_gpu(
    hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean",
    compute_grads=True, *, interpret=None,
):  # fmt: skip
    """hidden [T, H], weight [V, H], labels [T] int, bias [V] or None -> (loss float32 scalar,
    grad_hidden [T, H], grad_weight [V, H], grad_bias [V] or [0]); the Pallas Triton kernels
    (interpreted off-GPU) inside xla.py's chunk loop."""
    interpret = gpu_interpret() if interpret is None else interpret
    result = _flce_gpu(
        hidden, weight, labels, bias,
        ignore_index=int(ignore_index), label_smoothing=float(label_smoothing), z_loss=float(z_loss),
        reduction=reduction, interpret=interpret,
    )  # fmt: skip
    return result if compute_grads else loss_only(result, hidden, weight)


FUSED_LINEAR_CROSS_ENTROPY.register_jax("pallas_gpu", fused_linear_cross_entropy_pallas_gpu)
