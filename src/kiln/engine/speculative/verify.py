"""The verify step's sampling: turn the target's logits at every proposed position into the tokens
each speculating sequence emits (its accepted proposals, then one token of the target's own).

Sequence b proposed k_b tokens and the target scored k_b + 1 positions (its last token, then each
proposal): row j is the target's next-token distribution after proposal j - 1, at output position
t + j (t = the sequence's output tokens so far). Every rule below emits exactly what the target alone
would, on the same filtered, tempered distribution the plain sampler draws from
(kiln.engine.sampler.Sampler.probs; a structured-outputs request's rows masked by its grammar first,
kiln.engine.structured_outputs.mask_proposals):
- greedy sequences: accept while the proposal is the target's argmax, then emit the argmax;
- seeded sequences: the target's own sample at each position is argmax(p_j / E_(t+j)), with the
  noise E of that output position that plain seeded sampling uses (Sampler.exponentials); accept
  while the proposal equals it, then emit it. The tokens are those of plain seeded sampling,
  token for token, however many positions a step verifies (k_b depends on the rest of the batch);
- unseeded sequences: exact rejection sampling (kiln.engine.speculative.rejection_sampler), with k_b
  uniforms and (k_b + 1) x V exponentials from the sampler's shared generator.
"""

from __future__ import annotations

import torch

from kiln.engine.sampler import Sampler, SamplingError, non_finite_failures
from kiln.engine.sequence import Sequence
from kiln.engine.speculative.rejection_sampler import greedy_verify, rejection_sample
from kiln.engine.structured_outputs import mask_proposals


def verify_proposals(
    sampler: Sampler, logits: list[torch.Tensor], seqs: list[Sequence]
) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
    """logits[b]: float32 [k_b + 1, V], the target's rows for seqs[b], whose proposals are
    seqs[b].spec_token_ids (k_b of them, k_b >= 1) and, for a draft model that sampled them,
    seqs[b].spec_draft_probs float32 [k_b, V]. Returns per seq the emitted tokens (1 to k_b + 1)
    and, when its request asked for logprobs, one logprobs entry per emitted token. SamplingError
    (before anything is drawn) names the requests whose seed is refused or whose logits at any of
    their positions are not finite."""
    device = logits[0].device
    logits, failures = mask_proposals(logits, seqs)  # structured outputs' grammars, per position
    if failures:
        raise SamplingError(failures)
    _check(sampler, logits, seqs)
    tokens: list[list[int]] = [[] for _ in seqs]
    greedy = [b for b, seq in enumerate(seqs) if seq.params.greedy]
    seeded = [b for b, seq in enumerate(seqs) if not seq.params.greedy and seq.params.seed is not None]
    unseeded = [b for b, seq in enumerate(seqs) if not seq.params.greedy and seq.params.seed is None]
    if greedy:
        rows, drafts, counts = _pad([logits[b] for b in greedy], [seqs[b] for b in greedy], device)
        _emit(tokens, greedy, *greedy_verify(rows, drafts, counts))
    if seeded:
        group = [seqs[b] for b in seeded]
        rows, drafts, counts = _pad([logits[b] for b in seeded], group, device)
        target_probs = _target_probs(sampler, rows, group)
        noise = torch.ones_like(target_probs)
        for i, seq in enumerate(group):
            k, start = len(seq.spec_token_ids), seq.num_output_tokens
            noise[i, : k + 1] = sampler.exponentials(
                [seq] * (k + 1), list(range(start, start + k + 1)), rows.shape[2]
            )
        # argmax(p / E) is the target's own seeded sample at each position: verify against it as greedy
        _emit(tokens, seeded, *greedy_verify(target_probs / noise, drafts, counts))
    if unseeded:
        group = [seqs[b] for b in unseeded]
        rows, drafts, counts = _pad([logits[b] for b in unseeded], group, device)
        batch, width, vocab = rows.shape
        target_probs = _target_probs(sampler, rows, group)
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
            uniforms[i, :k] = torch.rand(k, generator=sampler.generator, device=device)
            exponentials[i, : k + 1].exponential_(generator=sampler.generator)
        out = rejection_sample(target_probs, drafts, counts, draft_probs, uniforms, exponentials)
        _emit(tokens, unseeded, *out)
    logprobs: list[list[dict[int, float]] | None] = [None] * len(seqs)
    for b, seq in enumerate(seqs):
        if seq.params.logprobs is not None:
            emitted = torch.tensor(tokens[b], device=device)
            rows = logits[b][: len(tokens[b])]
            logprobs[b] = Sampler.token_logprobs(rows, emitted, [seq.params.logprobs] * len(tokens[b]))
    return tokens, logprobs


def _check(sampler: Sampler, logits: list[torch.Tensor], seqs: list[Sequence]) -> None:
    """SamplingError for refused seeds and for sequences with a non-finite row among their k_b + 1."""
    failures = sampler.seed_failures(seqs)
    worst = torch.stack([_first_non_finite(rows.amax(dim=-1)) for rows in logits])
    failures.update(non_finite_failures(worst, seqs))
    if failures:
        raise SamplingError(failures)


def _first_non_finite(row_max: torch.Tensor) -> torch.Tensor:
    """The first non-finite value of a sequence's row maxima row_max [R], else its first (finite) one."""
    bad = ~torch.isfinite(row_max)
    return row_max[bad.int().argmax()]


def _target_probs(sampler: Sampler, rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Sampler.probs of padded target logits rows [B, K+1, V] -> float32 [B, K+1, V]."""
    batch, width, vocab = rows.shape
    params = [seq.params for seq in seqs for _ in range(width)]
    return sampler.probs(rows.reshape(batch * width, vocab), params).view(batch, width, vocab)


def _emit(tokens: list[list[int]], where: list[int], out: torch.Tensor, accepted: torch.Tensor) -> None:
    """tokens[where[i]] = out[i, : accepted[i] + 1] (the accepted proposals, then the target's token)."""
    for b, row, a in zip(where, out.tolist(), accepted.tolist(), strict=True):
        tokens[b] = row[: a + 1]


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
