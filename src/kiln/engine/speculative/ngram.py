"""N-gram (prompt-lookup) proposer: guess that the text repeats itself.

For n from ngram_max down to ngram_min, find an earlier occurrence of the sequence's last n tokens
(prompt and output alike) and propose the tokens that followed it. The latest occurrence that still
has k tokens after it wins (recent text is the better guess, a full-length guess the better bet);
without one, the occurrence with the longest continuation. No model runs and the proposal is
deterministic, so the rejection sampler treats q as one-hot.

The search is vectorized over a per-sequence numpy copy of the history that grows with it, so a step
costs a few array passes, not a Python loop over every earlier position.
"""

from __future__ import annotations

import numpy as np

from kiln.engine.sampler import Sampler
from kiln.engine.sequence import Sequence
from kiln.engine.speculative.proposal import Proposal


def ngram_propose(token_ids, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens continuing the latest earlier match of token_ids' last n tokens (longest n
    first, n in [ngram_min, ngram_max]); [] when no suffix recurs. token_ids: a list or 1-D int array."""
    tokens = np.asarray(token_ids)
    length = len(tokens)
    top = min(ngram_max, length - 1)
    if k < 1 or top < ngram_min:
        return []
    # ends e (exclusive) of earlier occurrences of the last ngram_min tokens, e in [ngram_min, length)
    ends = np.arange(ngram_min, length)
    for j in range(1, ngram_min + 1):
        ends = ends[tokens[ends - j] == tokens[length - j]]
        if not len(ends):
            return []
    # how far each occurrence's match extends (up to top tokens); longer n first
    matched = np.full(len(ends), ngram_min)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(ngram_min + 1, top + 1):
        alive &= ends >= j
        alive[alive] = tokens[ends[alive] - j] == tokens[length - j]
        matched[alive] = j
    for n in range(top, ngram_min - 1, -1):
        candidates = ends[matched >= n]
        if not len(candidates):
            continue
        full = candidates[candidates <= length - k]  # k tokens after it: the latest of those wins
        start = int(full[-1]) if len(full) else int(candidates[0])  # else the longest continuation
        return tokens[start : start + k].tolist()
    return []


class _History:
    """A sequence's token ids as a numpy array, appended to as the sequence grows."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.buffer = np.empty(0, dtype=np.int64)
        self.length = 0

    def tokens(self) -> np.ndarray:
        ids = self.seq.token_ids
        if len(ids) < self.length:  # cut (a stop string): start over
            self.length = 0
        if len(ids) > len(self.buffer):
            grown = np.empty(max(2 * len(self.buffer), len(ids), 256), dtype=np.int64)
            grown[: self.length] = self.buffer[: self.length]
            self.buffer = grown
        if len(ids) > self.length:
            self.buffer[self.length : len(ids)] = ids[self.length :]
            self.length = len(ids)
        return self.buffer[: self.length]


class NgramProposer:
    """Proposes by prompt lookup (see the module docstring)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.histories: dict[int, _History] = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int], sampler: Sampler) -> list[Proposal]:
        """Per seq at most max_tokens[i] proposed tokens (maybe none), continuing seq.token_ids."""
        proposals = []
        for seq, k in zip(seqs, max_tokens, strict=True):
            history = self.histories.get(id(seq))
            if history is None or history.seq is not seq:
                history = self.histories[id(seq)] = _History(seq)
            proposals.append(Proposal(ngram_propose(history.tokens(), k, self.ngram_min, self.ngram_max)))
        return proposals

    def release_finished(self) -> None:
        """Drop the histories of sequences that have finished (the engine calls it after a step)."""
        for key in [key for key, history in self.histories.items() if history.seq.is_finished]:
            del self.histories[key]
