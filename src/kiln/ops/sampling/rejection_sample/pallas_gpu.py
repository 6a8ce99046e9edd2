"""rejection_sample as one Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU). The rule is in
spec.py; the random numbers come in as arguments, so the result is a function of the inputs, equal to
xla.py's and pallas_tpu.py's.

Grid (B,): a program owns one sequence and does all of it, reading whole-array refs by index:
  1. the walk: p_j(d_j) and q_j(d_j) of every proposal gathered from the rows at once (one masked
     gather, [next_pow2(K)]), u_j < min(1, p / q) (q = 0: accept iff p > 0; no draft_probs: u_j < p);
     a, the accepted prefix, is the first position that is not accepted (or k_b);
  2. the draw from row a: a loop over the vocabulary in block_v pieces (masked loads, no padded copy
     of the [B, K+1, V] inputs) racing residual / noise, residual = max(0, p - q) (q = 0 for the bonus
     row, one-hot at the rejected token without draft_probs), and p / noise for the fallback, with a
     per-lane running best (strict >: the earlier block wins a tie); then the lanes are reduced to the
     lowest index of the maximum, as jnp.argmax. An all-zero residual falls back to p;
  3. the output row: d_0 .. d_{a-1}, the drawn token, then -1, and a.
Token ids come back in draft_token_ids' integer dtype (int32 unless jax_enable_x64 is on), as xla.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import gpu_interpret, pad_to
from kiln.ops.sampling.rejection_sample.spec import REJECTION_SAMPLE

MAX_BLOCK_V = 2048  # vocabulary columns per step of the draw loop (a power of two)
_MIN_BLOCK_V = 128  # a small vocabulary still gets a whole warp-friendly block (masked)


def _first_argmax(best, index, vocab):
    """The lowest index holding the largest of the per-lane bests -> int32 scalar."""
    return jnp.min(jnp.where(best == jnp.max(best), index, vocab))


def _kernel(p_ref, *refs, k_max: int, vocab: int, block_v: int, padded_k: int, has_draft_probs: bool):
    from jax.experimental.pallas import triton as plgpu

    if has_draft_probs:
        q_ref, noise_ref, tokens_ref, uniforms_ref, num_draft_ref, out_ref, accepted_ref = refs
    else:
        noise_ref, tokens_ref, uniforms_ref, num_draft_ref, out_ref, accepted_ref = refs
    b = pl.program_id(0)
    num_draft = num_draft_ref[b]

    # 1. the walk, every proposal at once
    positions = jax.lax.broadcasted_iota(jnp.int32, (padded_k,), 0)  # also the K + 1 output slots
    proposed = positions < num_draft
    tokens = jnp.where(proposed, tokens_ref[b, :], 0)  # padding entries may hold anything: never read p there
    row = jnp.full((padded_k,), b, jnp.int32)
    p_draft = plgpu.load(p_ref.at[row, positions, tokens], mask=proposed, other=0.0)
    if has_draft_probs:
        q_draft = plgpu.load(q_ref.at[row, positions, tokens], mask=proposed, other=0.0)
        ratio = jnp.minimum(p_draft / jnp.maximum(q_draft, jnp.finfo(jnp.float32).tiny), 1.0)
        accept_probability = jnp.where(q_draft > 0, ratio, jnp.where(p_draft > 0, 1.0, 0.0))
    else:
        accept_probability = p_draft  # q(d) = 1: min(1, p / 1) = p
    accepted = (uniforms_ref[b, :] < accept_probability) & proposed
    num_accepted = jnp.min(jnp.where(accepted, padded_k, positions))
    num_accepted = jnp.minimum(num_accepted, num_draft)
    rejected = num_accepted < num_draft
    rejected_token = jnp.max(jnp.where(positions == num_accepted, tokens, 0))

    # 2. the draw from row a
    columns0 = jax.lax.broadcasted_iota(jnp.int32, (block_v,), 0)
    q_row = jnp.minimum(num_accepted, k_max - 1)  # the bonus row has no q row: read any, masked

    def draw_step(step, carry):
        residual_best, residual_index, target_best, target_index, residual_max = carry
        start = pl.multiple_of(step * block_v, block_v)
        columns = start + columns0
        in_vocab = columns < vocab
        p = plgpu.load(p_ref.at[b, num_accepted, pl.ds(start, block_v)], mask=in_vocab, other=0.0)
        noise = plgpu.load(noise_ref.at[b, num_accepted, pl.ds(start, block_v)], mask=in_vocab, other=1.0)
        if has_draft_probs:
            q = plgpu.load(q_ref.at[b, q_row, pl.ds(start, block_v)], mask=in_vocab & rejected, other=0.0)
        else:
            q = jnp.where(rejected & (columns == rejected_token), 1.0, 0.0)
        residual = jnp.maximum(p - q, 0.0)
        # real columns score >= 0, columns past the vocabulary -1
        residual_score = jnp.where(in_vocab, residual / noise, -1.0)
        target_score = jnp.where(in_vocab, p / noise, -1.0)
        better = residual_score > residual_best
        residual_best = jnp.where(better, residual_score, residual_best)
        residual_index = jnp.where(better, columns, residual_index)
        better = target_score > target_best
        target_best = jnp.where(better, target_score, target_best)
        target_index = jnp.where(better, columns, target_index)
        return residual_best, residual_index, target_best, target_index, jnp.maximum(residual_max, residual)

    best = jnp.full((block_v,), -1.0, jnp.float32)
    index = jnp.full((block_v,), vocab, jnp.int32)
    init = (best, index, best, index, jnp.zeros((block_v,), jnp.float32))
    residual_best, residual_index, target_best, target_index, residual_max = jax.lax.fori_loop(
        0, pl.cdiv(vocab, block_v), draw_step, init
    )
    token = jnp.where(
        jnp.max(residual_max) > 0.0,  # an all-zero residual (p <= q everywhere) falls back to p
        _first_argmax(residual_best, residual_index, vocab),
        _first_argmax(target_best, target_index, vocab),
    )

    # 3. the output row: the accepted proposals, the drawn token, then -1
    out = jnp.where(positions < num_accepted, tokens, -1)
    out_ref[b, :] = jnp.where(positions == num_accepted, token, out)
    accepted_ref[b] = num_accepted


@functools.partial(jax.jit, static_argnames=("interpret",))
def _rejection_sample_gpu(
    target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials, interpret
):
    from jax.experimental.pallas import triton as plgpu

    batch, k_max = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    int_dtype = draft_token_ids.dtype
    if k_max == 0:  # no proposals: nothing to gather; one dummy column keeps every ref non-empty
        draft_probs = None
    padded_k = pl.next_power_of_2(k_max + 1)  # holds the K + 1 output positions
    block_v = min(MAX_BLOCK_V, max(_MIN_BLOCK_V, pl.next_power_of_2(vocab)))
    operands = [target_probs.astype(jnp.float32)]
    if draft_probs is not None:
        operands.append(draft_probs.astype(jnp.float32))
    operands += [
        exponentials.astype(jnp.float32),
        pad_to(draft_token_ids.astype(jnp.int32), 1, padded_k),  # small [B, K] rows: padded, not masked
        pad_to(uniforms.astype(jnp.float32), 1, padded_k),
        num_draft_tokens.astype(jnp.int32),
    ]
    kernel = functools.partial(
        _kernel,
        k_max=k_max,
        vocab=vocab,
        block_v=block_v,
        padded_k=padded_k,
        has_draft_probs=draft_probs is not None,
    )
    whole = pl.no_block_spec
    out, accepted = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[whole] * len(operands),
        out_specs=(whole, whole),
        out_shape=(
            jax.ShapeDtypeStruct((batch, padded_k), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(*operands)
    return out[:, : k_max + 1].astype(int_dtype), accepted.astype(num_draft_tokens.dtype)


def rejection_sample_pallas_gpu(
    target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials, *, interpret=None
):
    """target_probs [B, K+1, V] f32, draft_token_ids [B, K] int, num_draft_tokens [B] int, draft_probs
    [B, K, V] f32 or None, uniforms [B, K] f32, exponentials [B, K+1, V] f32 -> (output_token_ids
    [B, K+1] padded with -1, num_accepted [B]); the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    batch, k_max = draft_token_ids.shape
    if batch == 0:
        return (
            jnp.zeros((0, k_max + 1), draft_token_ids.dtype),
            jnp.zeros((0,), num_draft_tokens.dtype),
        )
    return _rejection_sample_gpu(
        target_probs,
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        uniforms,
        exponentials,
        interpret=interpret,
    )


REJECTION_SAMPLE.register_jax("pallas_gpu", rejection_sample_pallas_gpu)
