"""Speculative decoding: proposers guess several tokens, the target verifies them in one forward pass.

- config.py: SpeculativeConfig (method, num_speculative_tokens, n-gram lengths, draft model)
- ngram.py: prompt-lookup proposer; draft.py: draft-model proposer with its own paged KV cache
- rejection_sampler.py: greedy acceptance and exact rejection sampling on [B, K+1, V] tensors
- verify.py: the verify step's bookkeeping (ragged proposals -> padded tensors -> emitted tokens)
The scheduler gives decoding sequences proposal slots, the engine asks the proposer to fill them,
the model runner scores the last token plus the proposals as one extend query per sequence.
"""

from __future__ import annotations

from kiln.engine.speculative.config import SpeculativeConfig
from kiln.engine.speculative.ngram import NgramProposer
from kiln.engine.speculative.proposal import Proposal

__all__ = ["SpeculativeConfig", "NgramProposer", "Proposal", "make_proposer"]


def make_proposer(config: SpeculativeConfig, engine):
    """The proposer `config` asks for, built for `engine` (an LLMEngine: its device, block size,
    vocabulary and KV budget size the draft model's cache)."""
    if config.method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    from kiln.engine.speculative.draft import DraftProposer

    return DraftProposer.for_engine(config, engine)
