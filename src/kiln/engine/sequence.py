"""Sequence: one request's tokens, its progress through the KV cache, and its block table."""

from __future__ import annotations

import enum
import itertools
import time

import torch

from kiln.engine.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """One request as the scheduler sees it.

    token_ids: prompt then output tokens. The first num_computed_tokens of them have their KV in the
    cache (blocks in block_table, block i holds positions [i * block_size, (i + 1) * block_size)).
    During a speculative step the block table also covers the positions of spec_token_ids; the
    scheduler trims it back to the verified tokens afterwards.
    After preemption by recomputation the KV is dropped (num_computed_tokens = 0) and the whole of
    token_ids, generated tokens included, is prefilled again as if it were the prompt.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.arrival_index = next(_arrival_counter)  # preemption picks the newest
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.prompt_token_ids: list[int] = list(prompt_token_ids)  # its own copy: every output shares it
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at (first) admission
        self.preempted = False  # KV dropped once already (its re-admissions are not prompt lookups)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the full blocks registered so far (a chain)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # params.prompt_logprobs: entry i for prompt token i (None for the first, which has no context)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # the token ids params.min_tokens keeps from being sampled early: EOS (unless ignore_eos) and
        # stop_token_ids (set by the engine, which knows EOS; kiln.engine.logits_processors)
        self.min_tokens_stop_ids: list[int] = []
        # params.bad_words as token-id sequences (set by the engine, which has the tokenizer)
        self.bad_words_token_ids: list[list[int]] = []
        self.penalty_history = None  # its penalties' token counts (kiln.engine.logits_processors)
        # params.structured_outputs' matcher (set by the engine: kiln.engine.structured_outputs)
        self.grammar = None
        self.detokenizer = None  # set by the engine (kiln.engine.detokenizer.IncrementalDetokenizer)
        # output tokens and text characters already handed out (params.output_kind "delta")
        self.sent_tokens = 0
        self.sent_chars = 0
        self.sent_prompt_logprobs = False
        self.lane = 0  # which scheduler lane runs it (kiln.distributed.pipeline_lanes)
        # speculative decoding: this step's proposed tokens (never part of token_ids, whose KV they get
        # only once verified), and the draft's distributions they were drawn from (None = deterministic)
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None
        # an fp8 cache's exact positions (kiln.engine.exact_kv), while it holds blocks: the exact block
        # of its first block, its ring, and the (fp8 slot, exact slot) copies due before its next step
        self.exact_first: int | None = None
        self.exact_ring: list[int] | None = None
        self.exact_fill: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether prompt logprobs were asked for and not all taken yet (the prompt must be computed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.name})"
        )
