"""rejection_sample as two Pallas Mosaic TPU kernels (the TPU interpreter off a TPU). The rule is in
spec.py; the random numbers come in as arguments, so the result is a function of the inputs.

  1. gather (jnp): p_j(d_j) and q_j(d_j), [B, K]. Picking one entry per proposal out of a V-wide
     row is a gather over the vocabulary, not a Mosaic vector op; it stays in XLA, as in xla.py.
  2. the walk (kernel over tiles of block_rows sequences, [block_rows, K] in VMEM): u_j < min(1,
     p / q) (q = 0: accept iff p > 0) for every proposal at once; a, the accepted prefix, is the
     first column that is not accepted (or k_b). Sequences are padded to a multiple of block_rows
     with k_b = 0.
  3. the draw (kernel, grid (B, V / block_v)): a and the rejected token (-1 after the last proposal)
     are scalar-prefetched into SMEM, so each program's BlockSpec index_map reads row a of
     target_probs, draft_probs and exponentials straight from HBM (one row per program: the rows a
     tile would need come from different positions). The program races residual / noise, with
     residual = max(0, p - q) (q = 0 for the bonus row, one-hot at the rejected token without
     draft_probs), and p / noise for the fallback, keeping a per-lane running best in VMEM with a
     strict > (the earlier block wins a tie); the last V block reduces the lanes to the lowest index
     of the maximum, as jnp.argmax. The residual is not normalized (a positive scale: the argmax
     does not change, only float32 rounding can on a near-tie). A block past the vocabulary's end is
     masked by column.
  4. the output rows (jnp, elementwise): d_0 .. d_{a-1}, the drawn token, then -1.
Token ids come back in draft_token_ids' integer dtype (int32 unless jax_enable_x64 is on), as xla.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.pallas_common import LANES, pad_to, round_up, row_block, squeezed, tpu_interpret, tpu_params
from kiln.ops.sampling.rejection_sample.spec import REJECTION_SAMPLE

MAX_BLOCK_V = 16 * LANES  # vocabulary columns per draw program (a multiple of 128)


def _walk_kernel(p_ref, *refs, has_draft_probs):
    """[block_rows, K] gathered p(d), q(d), uniforms and [block_rows, 1] k_b -> [block_rows, 1] a."""
    if has_draft_probs:
        q_ref, u_ref, num_draft_ref, accepted_ref = refs
    else:
        u_ref, num_draft_ref, accepted_ref = refs
    p = p_ref[...]
    if has_draft_probs:
        q = q_ref[...]
        ratio = jnp.minimum(p / jnp.maximum(q, jnp.finfo(jnp.float32).tiny), 1.0)
        accept_probability = jnp.where(q > 0, ratio, jnp.where(p > 0, 1.0, 0.0))
    else:
        accept_probability = p  # q(d) = 1: min(1, p / 1) = p
    positions = jax.lax.broadcasted_iota(jnp.int32, p.shape, 1)
    accepted = (u_ref[...] < accept_probability) & (positions < num_draft_ref[...])
    accepted_ref[...] = jnp.min(jnp.where(accepted, p.shape[1], positions), axis=1, keepdims=True)


def _draw_kernel(rows_ref, rejected_tokens_ref, p_ref, noise_ref, *refs, vocab, has_draft_probs):
    """Row a of one sequence, one V block per step -> its drawn token, written at the last step."""
    if has_draft_probs:
        q_ref, out_ref, residual_best, residual_index, target_best, target_index, residual_max = refs
    else:
        out_ref, residual_best, residual_index, target_best, target_index, residual_max = refs
    seq, block = pl.program_id(0), pl.program_id(1)
    rejected_token = rejected_tokens_ref[seq]
    rejected = rejected_token >= 0

    @pl.when(block == 0)
    def _():
        residual_best[...] = jnp.full(residual_best.shape, -1.0, jnp.float32)
        target_best[...] = jnp.full(target_best.shape, -1.0, jnp.float32)
        residual_index[...] = jnp.full(residual_index.shape, vocab, jnp.int32)
        target_index[...] = jnp.full(target_index.shape, vocab, jnp.int32)
        residual_max[...] = jnp.zeros(residual_max.shape, jnp.float32)

    p = p_ref[...]  # [1, block_v]
    columns = block * p.shape[1] + jax.lax.broadcasted_iota(jnp.int32, p.shape, 1)
    in_vocab = columns < vocab
    if has_draft_probs:
        q = jnp.where(rejected, q_ref[...], 0.0)  # no q after the last proposal: the bonus row is p
    else:
        q = jnp.where(rejected & (columns == rejected_token), 1.0, 0.0)
    residual = jnp.maximum(p - q, 0.0)
    noise = noise_ref[...]
    # real columns score >= 0, columns past the vocabulary -1 (they may hold anything)
    for score, best, index in (
        (jnp.where(in_vocab, residual / noise, -1.0), residual_best, residual_index),
        (jnp.where(in_vocab, p / noise, -1.0), target_best, target_index),
    ):
        better = score > best[...]
        best[...] = jnp.where(better, score, best[...])
        index[...] = jnp.where(better, columns, index[...])
    residual_max[...] = jnp.maximum(residual_max[...], jnp.where(in_vocab, residual, 0.0))

    @pl.when(block == pl.num_programs(1) - 1)
    def _():
        def first_argmax(best, index):
            top = jnp.max(best[...], axis=1, keepdims=True)
            return jnp.min(jnp.where(best[...] == top, index[...], vocab), axis=1, keepdims=True)

        # an all-zero residual (p <= q everywhere) falls back to p
        has_residual = jnp.max(residual_max[...], axis=1, keepdims=True) > 0.0
        token = jnp.where(
            has_residual, first_argmax(residual_best, residual_index), first_argmax(target_best, target_index)
        )
        out_ref[...] = jnp.broadcast_to(token, out_ref.shape)


def _walk(p_draft, q_draft, uniforms, num_draft, interpret):
    """a [B] int32, the accepted prefix of every sequence (kernel 2 above)."""
    batch, k_max = p_draft.shape
    block_rows = row_block(batch, round_up(k_max, LANES) * 4 * 4, jnp.float32)
    padded = round_up(batch, block_rows)
    operands = [p_draft] + ([q_draft] if q_draft is not None else []) + [uniforms]
    operands = [pad_to(x, 0, padded) for x in operands] + [pad_to(num_draft[:, None], 0, padded)]
    tile = pl.BlockSpec((block_rows, k_max), lambda i: (i, 0))
    column = pl.BlockSpec((block_rows, 1), lambda i: (i, 0))
    accepted = pl.pallas_call(
        functools.partial(_walk_kernel, has_draft_probs=q_draft is not None),
        out_shape=jax.ShapeDtypeStruct((padded, 1), jnp.int32),
        grid=(padded // block_rows,),
        in_specs=[tile] * (len(operands) - 1) + [column],
        out_specs=column,
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(*operands)
    return accepted[:batch, 0]


def _draw(target_probs, draft_probs, exponentials, rows, rejected_tokens, interpret):
    """The drawn token [B] int32 of every sequence, from row rows[b] (kernel 3 above)."""
    batch, _, vocab = target_probs.shape
    block_v = vocab if vocab <= MAX_BLOCK_V else MAX_BLOCK_V

    # A unit dim before the vocabulary keeps each block's last two dims (1, block_v) legal for
    # Mosaic: 1 is the whole dim.
    def row_of(x):
        return x.reshape(x.shape[0], x.shape[1], 1, vocab)

    row_spec = pl.BlockSpec(
        (squeezed(), squeezed(), 1, block_v), lambda b, v, rows, tokens: (b, rows[b], 0, v)
    )
    operands, in_specs = [row_of(target_probs), row_of(exponentials)], [row_spec, row_spec]
    if draft_probs is not None:
        last_draft = draft_probs.shape[1] - 1  # the bonus row has no q row: read any, masked
        operands.append(row_of(draft_probs))
        in_specs.append(
            pl.BlockSpec(
                (squeezed(), squeezed(), 1, block_v),
                lambda b, v, rows, tokens: (b, jnp.minimum(rows[b], last_draft), 0, v),
            )
        )
    row_scratch = [pltpu.VMEM((1, block_v), dtype) for dtype in (jnp.float32, jnp.int32) * 2]
    tokens = pl.pallas_call(
        functools.partial(_draw_kernel, vocab=vocab, has_draft_probs=draft_probs is not None),
        out_shape=jax.ShapeDtypeStruct((batch, 1, LANES), jnp.int32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, pl.cdiv(vocab, block_v)),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((squeezed(), 1, LANES), lambda b, v, rows, tokens: (b, 0, 0)),
            scratch_shapes=[*row_scratch, pltpu.VMEM((1, block_v), jnp.float32)],
        ),
        compiler_params=tpu_params("parallel", "arbitrary"),
        interpret=interpret,
    )(rows, rejected_tokens, *operands)
    return tokens[:, 0, 0]


@functools.partial(jax.jit, static_argnames=("interpret",))
def _rejection_sample_tpu(
    target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials, interpret
):
    batch, k_max = draft_token_ids.shape
    int_dtype = draft_token_ids.dtype
    target_probs = target_probs.astype(jnp.float32)
    exponentials = exponentials.astype(jnp.float32)
    num_draft = num_draft_tokens.astype(jnp.int32)
    if k_max == 0:  # no proposals: every sequence draws its bonus token from row 0
        accepted, draft_probs = jnp.zeros((batch,), jnp.int32), None
        rejected_tokens = jnp.full((batch,), -1, jnp.int32)
    else:
        valid = jnp.arange(k_max)[None, :] < num_draft[:, None]
        tokens = jnp.where(valid, draft_token_ids, 0).astype(jnp.int32)
        p_draft = jnp.take_along_axis(target_probs[:, :k_max], tokens[..., None], axis=-1)[..., 0]
        q_draft = None
        if draft_probs is not None:
            draft_probs = draft_probs.astype(jnp.float32)
            q_draft = jnp.take_along_axis(draft_probs, tokens[..., None], axis=-1)[..., 0]
        accepted = _walk(p_draft, q_draft, uniforms.astype(jnp.float32), num_draft, interpret)
        at_accepted = jnp.take_along_axis(tokens, jnp.minimum(accepted, k_max - 1)[:, None], axis=1)[:, 0]
        rejected_tokens = jnp.where(accepted < num_draft, at_accepted, -1)
    last_token = _draw(target_probs, draft_probs, exponentials, accepted, rejected_tokens, interpret)
    positions = jnp.arange(k_max + 1)[None, :]
    padded = jnp.concatenate([draft_token_ids, jnp.full((batch, 1), -1, int_dtype)], axis=1)
    out = jnp.where(positions < accepted[:, None], padded, -1)
    out = jnp.where(positions == accepted[:, None], last_token[:, None].astype(int_dtype), out)
    return out.astype(int_dtype), accepted.astype(num_draft_tokens.dtype)


def rejection_sample_pallas_tpu(
    target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials, *, interpret=None
):
    """target_probs [B, K+1, V] f32, draft_token_ids [B, K] int, num_draft_tokens [B] int, draft_probs
    [B, K, V] f32 or None, uniforms [B, K] f32, exponentials [B, K+1, V] f32 -> (output_token_ids
    [B, K+1] padded with -1, num_accepted [B]); the Mosaic TPU kernels (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    batch, k_max = draft_token_ids.shape
    if batch == 0:
        return (
            jnp.zeros((0, k_max + 1), draft_token_ids.dtype),
            jnp.zeros((0,), num_draft_tokens.dtype),
        )
    return _rejection_sample_tpu(
        target_probs,
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        uniforms,
        exponentials,
        interpret=interpret,
    )


REJECTION_SAMPLE.register_jax("pallas_tpu", rejection_sample_pallas_tpu)
