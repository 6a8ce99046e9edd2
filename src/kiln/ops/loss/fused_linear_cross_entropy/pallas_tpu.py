"""fused_linear_cross_entropy with a Pallas Mosaic TPU row kernel (the TPU interpreter off a TPU).

The chunk loop is xla.py's: a lax.scan over chunks of tokens, the chunk's float32 logits from one
GEMM (rounded once to the inputs' dtype), then grad_hidden = dz @ W and the float32 accumulators
grad_weight += dz^T @ h, grad_bias += sum(dz). What changes is the row math (xla.py's
`rows_loss_and_grad`): a Mosaic kernel over the chunk's logits with grid
(row tiles, pass, vocabulary blocks), the last two axes sequential:

  pass 0 reads each [block_rows, block_v] block of logits and keeps, per row, in VMEM scratch: the
    running max m, the sums of exp(z - m) over all columns (d) and over the columns other than the
    label (d_others), both rescaled when m grows (online softmax), the target logit z_y and (label
    smoothing) the row sum of z.
  pass 1 reads each block again and writes scale * d loss / d logits over it (the output aliases the
    logits, so the gradient needs no buffer of its own); the last block writes the row losses.

others = d_others / d is the sum of the OTHER probabilities, which keeps float32's precision when the
model is confident (p_y -> 1, where lse - z_y and p_y - 1 cancel): -log p_y = -log1p(-others) when
others < 0.5, else lse - z_y; the target's gradient is softmax_scale * (1 - others) - (1 - eps) *
scale - eps * scale / V, the same numerics as the cpu, triton and xla backends. Having `others` from
pass 0 lets pass 1 write the target column in stride, block by block, so the gradient streams out
and no block is visited twice.

The output's block index stays at (tile, 0) through pass 0, which writes nothing: Pallas copies an
output block back only when its index changes (or at the last step), so pass 1's first block, the
same index, fills it before it ever leaves VMEM.

The vocabulary is padded to whole blocks (multiples of 128) with -inf logits (probability 0; their
gradient is written as 0 and sliced off with the padded weight rows), chunks of tokens to a multiple
of the row tile with ignored rows; an ignored row (label == ignore_index) gets loss 0 and a zero
gradient. The loss is float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.loss.fused_linear_cross_entropy.spec import FUSED_LINEAR_CROSS_ENTROPY
from kiln.ops.loss.fused_linear_cross_entropy.xla import HIGHEST, chunk_tokens_for, loss_only
from kiln.ops.pallas_common import LANES, pad_to, round_up, tpu_interpret, tpu_params

MAX_BLOCK_V = 16 * LANES  # vocabulary columns per block
MAX_BLOCK_ROWS = 64  # rows per tile: a [64, 2048] float32 block is 512 KiB; in + out, double-buffered, 2 MiB
MIN_CHUNK = 8  # float32 sublanes: a chunk is at least one full row tile


def vocab_blocking(vocab: int) -> tuple[int, int]:
    """(block_v, padded_vocab): blocks of at most MAX_BLOCK_V columns, each a multiple of 128, as
    even as possible, so the padding is under 128 columns per block."""
    num_blocks = -(-round_up(vocab, LANES) // MAX_BLOCK_V)
    block_v = round_up(-(-vocab // num_blocks), LANES)
    return block_v, num_blocks * block_v


def _rows_kernel(
    scale_ref, labels_ref, logits_ref, grad_ref, loss_ref, m_ref, d_ref, d_others_ref, z_y_ref, sum_ref,
    *, vocab, label_smoothing, z_loss,
):  # fmt: skip
    """One [block_rows, block_v] block of one pass; see the module docstring. labels: [block_rows, 1]
    int32, -1 on ignored rows."""
    pass_index, block = pl.program_id(1), pl.program_id(2)
    last_block = pl.num_programs(2) - 1
    labels = labels_ref[...]
    x = logits_ref[...]
    columns = block * x.shape[1] + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    is_target = columns == labels

    @pl.when((pass_index == 0) & (block == 0))
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        for ref in (d_ref, d_others_ref, z_y_ref, sum_ref):
            ref[...] = jnp.zeros(ref.shape, jnp.float32)

    @pl.when(pass_index == 0)
    def _():
        m_old = m_ref[...]
        m_new = jnp.maximum(m_old, jnp.max(x, axis=1, keepdims=True))
        # Block 0 holds column 0, a finite logit, so m_new is finite from the first block on; a block
        # of padding only (-inf) then adds exp(-inf) = 0.
        rescale = jnp.exp(m_old - m_new)
        e = jnp.exp(x - m_new)
        d_ref[...] = d_ref[...] * rescale + jnp.sum(e, axis=1, keepdims=True)
        others = jnp.sum(jnp.where(is_target, 0.0, e), axis=1, keepdims=True)
        d_others_ref[...] = d_others_ref[...] * rescale + others
        m_ref[...] = m_new
        z_y_ref[...] += jnp.sum(jnp.where(is_target, x, 0.0), axis=1, keepdims=True)
        if label_smoothing:
            sum_ref[...] += jnp.sum(jnp.where(columns < vocab, x, 0.0), axis=1, keepdims=True)

    valid = labels >= 0

    def lse_and_others():
        return m_ref[...] + jnp.log(d_ref[...]), d_others_ref[...] / d_ref[...]

    @pl.when(pass_index == 1)
    def _():
        lse, others = lse_and_others()
        row_scale = jnp.where(valid, scale_ref[0], 0.0)
        softmax_scale = row_scale * (1.0 + 2.0 * z_loss * lse)
        uniform = row_scale * (label_smoothing / vocab)
        target_grad = softmax_scale - (1.0 - label_smoothing) * row_scale - softmax_scale * others - uniform
        grad = jnp.where(is_target, target_grad, jnp.exp(x - lse) * softmax_scale - uniform)
        grad_ref[...] = jnp.where(valid & (columns < vocab), grad, 0.0)

    @pl.when((pass_index == 1) & (block == last_block))
    def _():
        lse, others = lse_and_others()
        nll = jnp.where(others < 0.5, -jnp.log1p(-others), lse - z_y_ref[...])
        loss = (1.0 - label_smoothing) * nll + z_loss * lse * lse
        if label_smoothing:
            loss += label_smoothing * (lse - sum_ref[...] / vocab)
        loss_ref[...] = jnp.where(valid, loss, 0.0)


def rows_loss_and_grad_tpu(logits, labels, scale, vocab, label_smoothing, z_loss, block_v, interpret):
    """float32 logits [C, Vp] (columns >= vocab are -inf, Vp a multiple of block_v), labels [C] int32
    (-1: ignored), scale: float32 scalar -> (row losses [C], scale * d loss / d logits [C, Vp], zero on
    the padded columns). C is a power of two >= 8, so the row tile min(C, MAX_BLOCK_ROWS) divides it."""
    rows, padded_vocab = logits.shape
    block_rows = min(rows, MAX_BLOCK_ROWS)
    grid = (rows // block_rows, 2, padded_vocab // block_v)
    row_column = pl.BlockSpec((block_rows, 1), lambda i, p, j: (i, 0))
    kernel = functools.partial(_rows_kernel, vocab=vocab, label_smoothing=label_smoothing, z_loss=z_loss)
    grad, row_loss = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            row_column,
            pl.BlockSpec((block_rows, block_v), lambda i, p, j: (i, j)),
        ],
        # pass 0 keeps the gradient's block index at (i, 0) and writes nothing (module docstring)
        out_specs=[pl.BlockSpec((block_rows, block_v), lambda i, p, j: (i, j * p)), row_column],
        out_shape=[
            jax.ShapeDtypeStruct((rows, padded_vocab), jnp.float32),
            jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        ],
        scratch_shapes=[pltpu.VMEM((block_rows, 1), jnp.float32) for _ in range(5)],
        input_output_aliases={2: 0},
        compiler_params=tpu_params("parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
    )(jnp.reshape(scale, (1,)).astype(jnp.float32), labels[:, None], logits)
    return row_loss[:, 0], grad


@functools.partial(
    jax.jit, static_argnames=("ignore_index", "label_smoothing", "z_loss", "reduction", "interpret")
)
def _flce_tpu(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, reduction, interpret):
    tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    block_v, padded_vocab = vocab_blocking(vocab)
    chunk = max(chunk_tokens_for(tokens, hidden_size, vocab), MIN_CHUNK)
    padded = round_up(tokens, chunk)
    h_chunks = pad_to(hidden, 0, padded).reshape(-1, chunk, hidden_size)
    valid = labels != ignore_index
    kernel_labels = jnp.pad(
        jnp.where(valid, labels, -1).astype(jnp.int32), (0, padded - tokens), constant_values=-1
    )
    label_chunks = kernel_labels.reshape(-1, chunk)
    num_valid = jnp.sum(valid).astype(jnp.float32)
    scale = 1.0 / num_valid if reduction == "mean" else jnp.float32(1.0)
    # Zero weight rows past the vocabulary: their logits are replaced by -inf, their gradient is 0.
    weight_p = pad_to(weight, 0, padded_vocab)
    w32 = weight_p.astype(jnp.float32)
    bias32 = pad_to(bias, 0, padded_vocab).astype(jnp.float32) if bias is not None else None
    in_vocab = jnp.arange(padded_vocab) < vocab

    def step(carry, chunk_inputs):
        loss_sum, grad_w, grad_b = carry
        h, lab = chunk_inputs
        logits = jnp.dot(h, weight_p.T, precision=HIGHEST, preferred_element_type=jnp.float32)
        if bias32 is not None:
            logits = logits + bias32
        logits = logits.astype(hidden.dtype).astype(jnp.float32)  # one rounding, as the torch backends
        logits = jnp.where(in_vocab, logits, -jnp.inf)
        rows, dz = rows_loss_and_grad_tpu(
            logits, lab, scale, vocab, label_smoothing, z_loss, block_v, interpret
        )
        grad_h = jnp.dot(dz, w32, precision=HIGHEST).astype(hidden.dtype)
        grad_w = grad_w + jnp.dot(dz.T, h.astype(jnp.float32), precision=HIGHEST)
        return (loss_sum + jnp.sum(rows), grad_w, grad_b + jnp.sum(dz, axis=0)), grad_h

    init = (
        jnp.float32(0.0),
        jnp.zeros((padded_vocab, hidden_size), jnp.float32),
        jnp.zeros((padded_vocab,), jnp.float32),
    )
    (loss_sum, grad_w, grad_b), grad_h = jax.lax.scan(step, init, (h_chunks, label_chunks))
    loss = loss_sum * scale
    grad_bias = grad_b[:vocab].astype(bias.dtype) if bias is not None else jnp.zeros((0,), hidden.dtype)
    return loss, grad_h.reshape(padded, hidden_size)[:tokens], grad_w[:vocab].astype(weight.dtype), grad_bias


def fused_linear_cross_entropy_pallas_tpu(
    hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean",
    compute_grads=True, *, interpret=None,
):  # fmt: skip
    """hidden [T, H], weight [V, H], labels [T] int, bias [V] or None -> (loss float32 scalar,
    grad_hidden [T, H], grad_weight [V, H], grad_bias [V] or [0]); the Mosaic TPU row kernel
    (interpreted off-TPU) inside xla.py's chunk loop."""
    interpret = tpu_interpret() if interpret is None else interpret
    result = _flce_tpu(
        hidden, weight, labels, bias,
        ignore_index=int(ignore_index), label_smoothing=float(label_smoothing), z_loss=float(z_loss),
        reduction=reduction, interpret=interpret,
    )  # fmt: skip
    return result if compute_grads else loss_only(result, hidden, weight)


FUSED_LINEAR_CROSS_ENTROPY.register_jax("pallas_tpu", fused_linear_cross_entropy_pallas_tpu)
