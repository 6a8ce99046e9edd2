"""Triton rejection_sample: one program per sequence, everything in one launch. See spec.py for the rule.

A program first walks its k_b proposals with scalar loads (p(d_j), q(d_j), u_j), accepting while
u_j < min(1, p/q); the walk stops counting at the first rejection, at row a. It then streams row a
over the vocabulary in BLOCK_V chunks: the residual r = max(0, p_a - q_a) at a rejection, or p_a
itself for the bonus row (a = k_b), divided by the Exp(1) noise, keeping a running argmax. The residual
is never normalized: dividing by its sum is a positive scale and leaves the argmax unchanged, so one
pass suffices. The same pass keeps the argmax of p_a / noise and the largest residual entry, for the
fallback to p_a when the residual is zero everywhere. Ties go to the lowest index (tl.argmax within a
block, a strict > across blocks), as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.sampling.rejection_sample.spec import REJECTION_SAMPLE

MAX_BLOCK_V = 4096


@triton.jit
def _rejection_sample_kernel(
    target_ptr,
    draft_probs_ptr,
    draft_ids_ptr,
    num_draft_ptr,
    uniforms_ptr,
    noise_ptr,
    out_ids_ptr,
    num_accepted_ptr,
    target_seq_stride,
    target_row_stride,
    draft_probs_seq_stride,
    draft_probs_row_stride,
    noise_seq_stride,
    noise_row_stride,
    k_max,
    vocab,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    target_seq = target_ptr + seq * target_seq_stride
    draft_probs_seq = draft_probs_ptr + seq * draft_probs_seq_stride
    num_draft = tl.load(num_draft_ptr + seq)

    # ---- the walk: a counts the accepted prefix; a proposal after a rejection no longer counts
    a = num_draft * 0
    for j in range(0, k_max):
        live = (a == j) & (j < num_draft)
        token = tl.load(draft_ids_ptr + seq * k_max + j)
        token = tl.where(j < num_draft, token, 0)  # padding proposals may hold anything
        p = tl.load(target_seq + j * target_row_stride + token).to(tl.float32)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_seq + j * draft_probs_row_stride + token).to(tl.float32)
        else:
            q = p * 0.0 + 1.0  # a deterministic proposer: q one-hot at the proposal
        u = tl.load(uniforms_ptr + seq * k_max + j).to(tl.float32)
        ratio = tl.minimum(p / tl.maximum(q, 1.1754943508222875e-38), 1.0)
        accept = tl.where(q > 0.0, u < ratio, p > 0.0)
        a += (live & accept).to(a.dtype)

    # ---- the draw from row a: the residual at a rejection, p itself for the bonus row
    rejected = a < num_draft
    rejected_token = tl.load(draft_ids_ptr + seq * k_max + a, mask=rejected, other=0)
    target_row = target_seq + a * target_row_stride
    noise_row = noise_ptr + seq * noise_seq_stride + a * noise_row_stride
    best_residual = tl.full((), -1.0, tl.float32)
    best_residual_index = tl.full((), 0, tl.int32)
    best_target = tl.full((), -1.0, tl.float32)
    best_target_index = tl.full((), 0, tl.int32)
    largest_residual = tl.full((), 0.0, tl.float32)
    offsets = tl.arange(0, BLOCK_V)
    for start in range(0, vocab, BLOCK_V):
        cols = start + offsets
        mask = cols < vocab
        p = tl.load(target_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DRAFT_PROBS:
            q_row = draft_probs_seq + a * draft_probs_row_stride
            # no q row to read after the last proposal (the bonus row): q = 0 there
            q_mask = cols < tl.where(rejected, vocab, 0)
            q = tl.load(q_row + cols, mask=q_mask, other=0.0).to(tl.float32)
        else:
            q = tl.where((cols == rejected_token) & rejected, 1.0, 0.0)
        residual = tl.maximum(p - q, 0.0)
        noise = tl.load(noise_row + cols, mask=mask, other=1.0).to(tl.float32)
        # scores are >= 0 on real columns, -1 past the vocabulary
        residual_score = tl.where(mask, residual / noise, -1.0)
        target_score = tl.where(mask, p / noise, -1.0)
        largest_residual = tl.maximum(largest_residual, tl.max(residual, axis=0))

        block_best = tl.max(residual_score, axis=0)
        block_index = start + tl.argmax(residual_score, axis=0)
        better = block_best > best_residual
        best_residual = tl.where(better, block_best, best_residual)
        best_residual_index = tl.where(better, block_index, best_residual_index)

        block_best = tl.max(target_score, axis=0)
        block_index = start + tl.argmax(target_score, axis=0)
        better = block_best > best_target
        best_target = tl.where(better, block_best, best_target)
        best_target_index = tl.where(better, block_index, best_target_index)
    last_token = tl.where(largest_residual > 0.0, best_residual_index, best_target_index)

    # ---- outputs: d_0 .. d_{a-1}, the drawn token, then -1
    positions = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ids_ptr + seq * k_max + positions, mask=positions < a, other=-1)
    out = tl.where(positions == a, last_token.to(tl.int64), drafts.to(tl.int64))
    tl.store(out_ids_ptr + seq * (k_max + 1) + positions, out, mask=positions < k_max + 1)
    tl.store(num_accepted_ptr + seq, a.to(tl.int64))


def rejection_sample_triton(
    target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials
):
    """Shapes and dtypes as kiln.ops.rejection_sample (spec.py)."""
    batch, rows, vocab = target_probs.shape
    k_max = rows - 1
    device = target_probs.device
    output_token_ids = empty((batch, k_max + 1), torch.int64, device)
    num_accepted = empty((batch,), torch.int64, device)
    if batch == 0:
        return output_token_ids, num_accepted
    target_probs = target_probs.contiguous()
    exponentials = exponentials.contiguous()
    draft_probs = draft_probs.contiguous() if draft_probs is not None else None
    draft_probs_arg = draft_probs if draft_probs is not None else target_probs
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    _rejection_sample_kernel[(batch,)](
        target_probs,
        draft_probs_arg,
        draft_token_ids.contiguous(),
        num_draft_tokens.contiguous(),
        uniforms.contiguous(),
        exponentials,
        output_token_ids,
        num_accepted,
        target_probs.stride(0),
        target_probs.stride(1),
        draft_probs_arg.stride(0),
        draft_probs_arg.stride(1),
        exponentials.stride(0),
        exponentials.stride(1),
        k_max,
        vocab,
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_K=triton.next_power_of_2(k_max + 1),
        BLOCK_V=block_v,
        num_warps=min(max(block_v // 512, 1), 8),
    )
    return output_token_ids, num_accepted


REJECTION_SAMPLE.register(Implementation("triton", rejection_sample_triton, triton_available))
