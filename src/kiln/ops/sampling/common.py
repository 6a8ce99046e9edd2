"""What the sampling ops and the engine's greedy verify share: laying out the tokens a verify step
emits."""

from __future__ import annotations

import torch


def emitted_token_ids(
    draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, last_token: torch.Tensor
) -> torch.Tensor:
    """draft_token_ids int64 [B, K], num_accepted int64 [B] (a_b <= K), last_token int64 [B] ->
    int64 [B, K+1]: row b is d_0 .. d_{a_b - 1}, then last_token[b], then -1 padding."""
    batch, k_max = draft_token_ids.shape
    positions = torch.arange(k_max + 1, device=draft_token_ids.device)[None, :]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    out = torch.where(positions < num_accepted[:, None], padded, -1)
    return out.scatter_(1, num_accepted[:, None], last_token[:, None])
