"""Scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step: running decodes first (one token each), then running prefills that are part-way
through, then new requests from the waiting queue, until `max_num_batched_tokens` tokens or
`max_num_seqs` sequences. A prefill longer than the budget left is cut into chunks over steps.
When a running sequence needs a KV block and none is free, the newest running request is
preempted by recomputation: its blocks are freed, and it goes back to the front of the waiting
queue with its generated tokens kept in token_ids, to be prefilled again when blocks free up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kiln.engine.block_manager import BlockManager
from kiln.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes num_tokens[i] tokens from its num_computed_tokens on."""

    seqs: list[Sequence]
    num_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ----
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: dict[int, tuple[Sequence, int]] = {}  # id(seq) -> (seq, tokens), in schedule order
        preempted = False
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted a moment ago to make room for an older one
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, n):
                victim = max(self.running, key=lambda s: s.arrival_index)  # the newest, maybe seq itself
                if id(victim) in scheduled:  # already in this step (decodes go first): take it back out
                    budget += scheduled.pop(id(victim))[1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.allocate(seq, n)
                scheduled[id(seq)] = (seq, n)
                budget -= n
        # admit new work only when nothing had to be preempted (else it would be preempted right back)
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.block_manager.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, n):
                self.block_manager.unmatch_prefix(seq)
                break
            self.block_manager.allocate(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[id(seq)] = (seq, n)
            budget -= n
        return ScheduledBatch([s for s, _ in scheduled.values()], [n for _, n in scheduled.values()])

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the model ran ----
    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Advance each scheduled seq by its computed tokens, append sampled tokens (None = prefill
        not finished yet), stop on EOS / stop token / length. Returns the seqs that got a token."""
        advanced = []
        for seq, n, token in zip(batch.seqs, batch.num_tokens, sampled, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.register_computed_blocks(seq)
            if token is None:
                continue
            seq.token_ids.append(token)
            advanced.append(seq)
            params = seq.params
            if not params.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, "stop")
            elif params.stop_token_ids and token in params.stop_token_ids:
                self.finish(seq, "stop")
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")
        return advanced

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (stop, length or abort) and give its blocks back."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
