"""N-gram (prompt-lookup) proposer: guess that the text repeats itself.

For n from ngram_max down to ngram_min, find an earlier occurrence of the sequence's last n tokens
(prompt and output alike) and propose the tokens that followed it. The latest occurrence that still
has k tokens after it wins (recent text is the better guess, a full-length guess the better bet);
without one, the occurrence with the longest continuation. No model runs and the proposal is
deterministic, so the rejection sampler treats q as one-hot.
"""

from __future__ import annotations

from kiln.engine.sampler import Sampler
from kiln.engine.sequence import Sequence
from kiln.engine.speculative.proposal import Proposal


def ngram_propose(token_ids: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens continuing the latest earlier match of token_ids' last n tokens (longest n
    first, n in [ngram_min, ngram_max]); [] when no suffix recurs."""
    length = len(token_ids)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        pattern = token_ids[length - n :]
        best_start, best_len = -1, 0
        # candidate matches end at e (exclusive) with e < length: scan e from the latest backwards
        for end in range(length - 1, n - 1, -1):
            if token_ids[end - 1] != pattern[-1] or token_ids[end - n : end] != pattern:
                continue
            available = min(k, length - end)
            if available > best_len:
                best_start, best_len = end, available
                if available == k:
                    break
        if best_len:
            return token_ids[best_start : best_start + best_len]
    return []


class NgramProposer:
    """Proposes by prompt lookup (see the module docstring)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, seqs: list[Sequence], max_tokens: list[int], sampler: Sampler) -> list[Proposal]:
        """Per seq at most max_tokens[i] proposed tokens (maybe none), continuing seq.token_ids."""
        return [
            Proposal(ngram_propose(seq.token_ids, k, self.ngram_min, self.ngram_max))
            for seq, k in zip(seqs, max_tokens, strict=True)
        ]

    def release_finished(self) -> None:
        """Nothing to free: the n-gram proposer keeps no per-sequence state."""
