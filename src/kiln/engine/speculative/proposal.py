"""Proposal: what a proposer hands the verify step for one sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """token_ids: the proposed continuation (possibly empty). draft_probs: float32 [len(token_ids),
    vocab], the distributions the tokens were drawn from, or None when the proposal is deterministic
    (n-gram lookup, a greedy draft): the rejection sampler then treats q as one-hot."""

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None
