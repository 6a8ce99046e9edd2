"""The verify step's sampling: turn the target's logits at every proposed position into the tokens
each speculating sequence emits (its accepted proposals, then one token of the target's own).

Sequence b proposed k_b tokens and the target scored k_b + 1 positions (its last token, then each
proposal): row j is the target's next-token distribution after proposal j - 1. Greedy sequences are
verified by argmax, sampling ones by exact rejection sampling on the same filtered, tempered
distribution the plain sampler draws from (kiln.engine.sampler.Sampler.probs), with their random
numbers drawn from their own generator, k_b uniforms then (k_b + 1) x V exponentials per step, so a
seeded request's tokens depend only on its seed and its own logits.
"""

from __future__ import annotations

import torch

from kiln.engine.sampler import Sampler
from kiln.engine.sequence import Sequence
from kiln.engine.speculative.rejection_sampler import greedy_verify, rejection_sample


def verify_proposals(
    sampler: Sampler, logits: list[torch.Tensor], seqs: list[Sequence]
) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
    """logits[b]: float32 [k_b + 1, V], the target's rows for seqs[b], whose proposals are
    seqs[b].spec_token_ids (k_b of them, k_b >= 1) and, for a draft model that sampled them,
    seqs[b].spec_draft_probs float32 [k_b, V]. Returns per seq the emitted tokens (1 to k_b + 1)
    and, when its request asked for logprobs, one logprobs entry per emitted token."""
    device = logits[0].device
    tokens: list[list[int]] = [[] for _ in seqs]
    greedy = [b for b, seq in enumerate(seqs) if seq.params.greedy]
    sampling = [b for b, seq in enumerate(seqs) if not seq.params.greedy]
    if greedy:
        rows, drafts, counts = _pad([logits[b] for b in greedy], [seqs[b] for b in greedy], device)
        out, accepted = greedy_verify(rows, drafts, counts)
        for b, row, a in zip(greedy, out.tolist(), accepted.tolist(), strict=True):
            tokens[b] = row[: a + 1]
    if sampling:
        group = [seqs[b] for b in sampling]
        sampler.make_generators(group, device)
        rows, drafts, counts = _pad([logits[b] for b in sampling], group, device)
        batch, width, vocab = rows.shape
        params = [seq.params for seq in group for _ in range(width)]
        target_probs = sampler.probs(rows.reshape(batch * width, vocab), params).view(batch, width, vocab)
        draft_probs = None
        if any(seq.spec_draft_probs is not None for seq in group):
            draft_probs = torch.zeros(batch, width - 1, vocab, device=device)
            for i, seq in enumerate(group):
                k = len(seq.spec_token_ids)
                if seq.spec_draft_probs is None:  # a deterministic proposal: q one-hot
                    draft_probs[i, :k].scatter_(-1, drafts[i, :k, None], 1.0)
                else:
                    draft_probs[i, :k] = seq.spec_draft_probs
        uniforms = torch.zeros(batch, width - 1, device=device)
        exponentials = torch.ones(batch, width, vocab, device=device)
        for i, seq in enumerate(group):
            k = len(seq.spec_token_ids)
            generator = sampler.generator_for(seq)
            uniforms[i, :k] = torch.rand(k, generator=generator, device=device)
            exponentials[i, : k + 1].exponential_(generator=generator)
        out, accepted = rejection_sample(target_probs, drafts, counts, draft_probs, uniforms, exponentials)
        for b, row, a in zip(sampling, out.tolist(), accepted.tolist(), strict=True):
            tokens[b] = row[: a + 1]
    logprobs: list[list[dict[int, float]] | None] = [None] * len(seqs)
    for b, seq in enumerate(seqs):
        if seq.params.logprobs is not None:
            emitted = torch.tensor(tokens[b], device=device)
            rows = logits[b][: len(tokens[b])]
            logprobs[b] = Sampler.token_logprobs(rows, emitted, [seq.params] * len(tokens[b]))
    return tokens, logprobs


def _pad(
    logits: list[torch.Tensor], seqs: list[Sequence], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack ragged rows: logits [B, K+1, V] (padding rows zero), proposals int64 [B, K] (padding 0),
    proposal counts int64 [B]."""
    width = max(row.shape[0] for row in logits)
    vocab = logits[0].shape[1]
    rows = torch.zeros(len(logits), width, vocab, device=device)
    drafts = torch.zeros(len(logits), width - 1, dtype=torch.int64, device=device)
    for i, (row, seq) in enumerate(zip(logits, seqs, strict=True)):
        rows[i, : row.shape[0]] = row
        drafts[i, : len(seq.spec_token_ids)] = torch.tensor(seq.spec_token_ids, device=device)
    counts = torch.tensor([len(seq.spec_token_ids) for seq in seqs], dtype=torch.int64, device=device)
    return rows, drafts, counts
