"""Verification of proposed tokens: greedy acceptance and exact rejection sampling.

Rejection sampling is the op kiln.ops.rejection_sample (src/kiln/ops/sampling/rejection_sample/: the
rule, its float64 reference, a vectorized torch path and a fused Triton kernel); this module is where
the engine calls it. Proposal d_j, drawn from the draft's q_j, is accepted with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from the normalized residual
max(0, p_j - q_j) instead, and after the last proposal a bonus token from p_k, so every emitted token
follows the target alone. For a deterministic proposer (n-gram) q_j is one-hot at d_j.

Greedy rows take the argmax instead: accept while the proposal equals the target's argmax, then emit
the argmax at the first mismatch (or after the last proposal), which is what decoding one token at
a time would give.

Randomness comes in as arguments (uniforms for acceptance, Exp(1) noise for the draws, whose
argmax(probs / noise) is an exact sample of probs), so the engine can draw them from its generator
and tests can draw them in bulk. Seeded requests are verified with greedy_verify on probs / noise
instead, noise keyed by (seed, output position): see kiln.engine.speculative.verify.
"""

from __future__ import annotations

import torch

import kiln.ops
from kiln.ops.sampling.common import emitted_token_ids


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify B sequences' proposals at once (kiln.ops.rejection_sample).

    target_probs: float32 [B, K+1, V], the target's (filtered, tempered) distribution at each
        proposal's position and one past the last; rows past num_draft_tokens[b] + 1 are padding.
    draft_token_ids: int64 [B, K], proposals (padding past num_draft_tokens[b] is ignored).
    num_draft_tokens: int64 [B], k_b <= K.
    draft_probs: float32 [B, K, V], the distributions the proposals were drawn from, or None for a
        deterministic proposer (q one-hot at the proposal).
    uniforms: float32 [B, K] in [0, 1); exponentials: float32 [B, K+1, V], i.i.d. Exp(1).
    Returns (output_token_ids int64 [B, K+1], padded with -1, num_accepted int64 [B]): sequence b
    emits output_token_ids[b, : num_accepted[b] + 1].
    """
    return kiln.ops.rejection_sample(
        target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials
    )


def greedy_verify(
    target_logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: the target's token at each position is target_logits' argmax (logits, or
    any scores whose argmax is the target's token). target_logits: [B, K+1, V]; draft_token_ids int64 [B, K];
    num_draft_tokens int64 [B]. Returns (output_token_ids int64 [B, K+1] padded with -1,
    num_accepted int64 [B]), as rejection_sample."""
    k_max = draft_token_ids.shape[1]
    argmax = target_logits.argmax(dim=-1)  # [B, K+1]
    positions = torch.arange(k_max, device=argmax.device)
    valid = positions[None, :] < num_draft_tokens[:, None]
    matches = (argmax[:, :k_max] == draft_token_ids) & valid
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    last_token = argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return emitted_token_ids(draft_token_ids, num_accepted, last_token), num_accepted
