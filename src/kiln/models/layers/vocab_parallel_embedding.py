"""Vocab-parallel token embedding and LM head.

Rank r owns vocabulary rows [v0, v1) of the embedding table (and of the LM head, tied or not).
  embedding: each rank looks up the ids it owns, writes zeros for the others, and one all-reduce sums
             the ranks' rows (exactly one rank contributes each token's row);
  LM head:   each rank computes logits for its vocabulary slice; they are gathered, in rank order,
             to rank 0, which samples (the other ranks never need full logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.distributed.collectives import all_reduce, gather_to_first
from kiln.distributed.groups import TPGroup


class VocabParallelEmbedding(torch.nn.Module):
    """input_ids int64 [T] (global ids) -> [T, hidden] in the table's dtype.

    weight: this rank's rows [v1 - v0, hidden]; vocab_start: v0.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: TPGroup):
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside[:, None], 0.0)
        return all_reduce(rows, self.group)

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_end}), rank={self.group.rank}"


class ParallelLMHead(torch.nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] on rank 0 (rank order = vocabulary order); the other
    ranks return their local slice [N, v1 - v0] (only rank 0 samples).

    local: the Linear over this rank's LM-head rows; vocab_sizes: every rank's slice length.
    """

    def __init__(self, local: torch.nn.Module, vocab_sizes: list[int], group: TPGroup):
        super().__init__()
        self.local = local
        self.vocab_sizes = list(vocab_sizes)
        self.group = group

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "local":
                raise
            return getattr(self.local, name)

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        logits = self.local(hidden, *args, **kwargs)
        parts = gather_to_first(logits, self.vocab_sizes, self.group)
        return logits if parts is None else torch.cat(parts, dim=-1)
