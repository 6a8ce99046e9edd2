"""rejection_sample as a few vectorized torch passes over [B, K+1, V] (the path the engine runs on the
CPU; any device works). See spec.py for the rule.

All k proposals' acceptances and residuals are computed at once; the accepted prefix is the cumulative
product of the acceptances, and the last token is drawn from the row it selects. Unlike the Triton
kernel it normalizes the residual (a positive scale: the argmax does not change)."""

from __future__ import annotations

import torch

from kiln.ops.registry import Implementation, cpu_only
from kiln.ops.sampling.common import emitted_token_ids
from kiln.ops.sampling.rejection_sample.spec import REJECTION_SAMPLE


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) per proposal, [B, K]; a proposal the draft could not have drawn
    (q(d) = 0) is accepted only if the target could (p(d) > 0)."""
    ratio = p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny)
    return torch.where(q_draft > 0, ratio.clamp(max=1.0), (p_draft > 0).to(p_draft.dtype))


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) normalized over the vocabulary, [..., V]; where p <= q everywhere (p == q: a
    rejection then has probability 0) it falls back to p."""
    residual = (target_probs - draft_probs).clamp_min(0.0)
    total = residual.sum(dim=-1, keepdim=True)
    tiny = torch.finfo(total.dtype).tiny
    return torch.where(total > 0, residual / total.clamp_min(tiny), target_probs)


def rejection_sample_cpu(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes and dtypes as kiln.ops.rejection_sample (spec.py)."""
    batch, k_max = draft_token_ids.shape
    device = target_probs.device
    positions = torch.arange(k_max, device=device)
    valid = positions[None, :] < num_draft_tokens[:, None]
    safe_tokens = torch.where(valid, draft_token_ids, 0)
    p_draft = target_probs[:, :k_max].gather(-1, safe_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        one_hot = torch.zeros_like(target_probs[:, :k_max]).scatter_(-1, safe_tokens[..., None], 1.0)
        residual = residual_distribution(target_probs[:, :k_max], one_hot)
    else:
        q_draft = draft_probs.gather(-1, safe_tokens[..., None]).squeeze(-1)
        residual = residual_distribution(target_probs[:, :k_max], draft_probs)
    accepted = (uniforms < acceptance_probability(p_draft, q_draft)) & valid
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    # the last emitted token: from the residual at the first rejection, from p after the last proposal
    last_rows = torch.cat([residual, target_probs[:, k_max:]], dim=1)  # [B, K+1, V]
    bonus_row = torch.arange(k_max + 1, device=device)[None, :] >= num_draft_tokens[:, None]
    last_rows = torch.where(bonus_row[..., None], target_probs, last_rows)
    row = num_accepted[:, None, None].expand(batch, 1, target_probs.shape[-1])
    dist = last_rows.gather(1, row).squeeze(1)
    noise = exponentials.gather(1, row).squeeze(1)
    last_token = (dist / noise).argmax(dim=-1)
    return emitted_token_ids(draft_token_ids, num_accepted, last_token), num_accepted


REJECTION_SAMPLE.register(Implementation("cpu", rejection_sample_cpu, cpu_only))
# The plain torch function is also the bench's baseline for the Triton kernel, on the same GPU tensors.
REJECTION_SAMPLE.baselines["torch_vectorized"] = rejection_sample_cpu
