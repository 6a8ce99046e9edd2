"""Scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step: running decodes first (one token each), then running prefills that are part-way
through, then new requests from the waiting queue, until `max_num_batched_tokens` tokens or
`max_num_seqs` sequences. A prefill longer than the budget left is cut into chunks over steps.
When a running sequence needs a KV block and none is free, the newest running request is
preempted by recomputation: its blocks are freed, and it goes back to the front of the waiting
queue with its generated tokens kept in token_ids, to be prefilled again when blocks free up.

Speculative decoding (num_speculative_tokens > 0): a decoding sequence may also get up to that many
slots for proposed tokens (batch.spec_caps), capped by the token budget, its max_tokens and
max_model_len, and dropped rather than preempting anyone when the blocks are short. After the step
only the verified tokens count as computed, and blocks past them are released.

Requests that asked for prompt logprobs get the logits of every prompt position: at most
PROMPT_LOGPROB_ROWS such rows a step ([rows, vocab] float32: 0.5 GiB at a 128k vocabulary), so their
prefill is chunked to fit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.engine.block_manager import BlockManager
from kiln.engine.sequence import Sequence, SequenceStatus

PROMPT_LOGPROB_ROWS = 1024


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes num_tokens[i] tokens from its num_computed_tokens on.

    spec_caps[i] (empty = no speculation) of those are slots for proposed tokens: the engine fills
    seqs[i].spec_token_ids with at most that many and lowers num_tokens[i] to 1 + how many it got."""

    seqs: list[Sequence]
    num_tokens: list[int]
    spec_caps: list[int] = field(default_factory=list)

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
        num_speculative_tokens: int = 0,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_speculative_tokens = num_speculative_tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ----
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        prompt_rows = PROMPT_LOGPROB_ROWS  # logits rows of prompt positions left this step
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
            if seq.prompt_logprobs_pending:
                if not prompt_rows:
                    continue
                n = min(n, prompt_rows)
            while not self.block_manager.can_allocate(seq, n):
                victim = max(self.running, key=lambda s: s.arrival_index)  # the newest, maybe seq itself
                if id(victim) in scheduled:  # already in this step (decodes go first): take it back out
                    taken = scheduled.pop(id(victim))[1]
                    budget += taken
                    prompt_rows += taken if victim.prompt_logprobs_pending else 0
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.allocate(seq, n)
                scheduled[id(seq)] = (seq, n)
                budget -= n
                prompt_rows -= n if seq.prompt_logprobs_pending else 0
        # admit new work only when nothing had to be preempted (else it would be preempted right back)
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.prompt_logprobs_pending and not prompt_rows:
                break
            self.block_manager.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget, prompt_rows if seq.prompt_logprobs_pending else budget)
            # beside running work, only a request whose whole prefill fits now: one admitted on its
            # first chunk ran out of blocks chunks later, preempted itself (the newest) and started
            # over, every few steps while an older one ran (48x the model work, no prefix cache)
            if not self.block_manager.can_allocate(seq, seq.num_uncomputed_tokens if self.running else n):
                self.block_manager.unmatch_prefix(seq)
                break
            self.block_manager.allocate(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[id(seq)] = (seq, n)
            budget -= n
            prompt_rows -= n if seq.prompt_logprobs_pending else 0
        if self.num_speculative_tokens:
            budget = self._grant_proposal_slots(scheduled, budget)
        seqs = [s for s, _ in scheduled.values()]
        num_tokens = [n for _, n in scheduled.values()]
        spec_caps = []
        if self.num_speculative_tokens:
            spec_caps = [
                n - s.num_uncomputed_tokens if n > s.num_uncomputed_tokens else 0
                for s, n in scheduled.values()
            ]
        return ScheduledBatch(seqs, num_tokens, spec_caps)

    def _grant_proposal_slots(self, scheduled: dict[int, tuple[Sequence, int]], budget: int) -> int:
        """Give the scheduled decodes their proposal slots, oldest first, from what is left once every
        running request's real tokens and the admissions are scheduled: a guess never takes the token
        budget of a waiting request or the block another running request needs for its real token
        (which preempted it), and is never itself a reason to preempt. It may evict a cached prefix block
        (the LRU one, plain free blocks going first) as a real token would: once the prefix cache fills
        the pool nearly every free block is a cached one, and guesses kept off them mostly stopped
        (-25% proposals at 16-token blocks, -75% at 4) to save ceil(k / block_size) cached blocks per
        speculating sequence (such a block comes back unnamed after the step; the next guesses reuse
        it). Returns the budget left."""
        for key, (seq, n) in scheduled.items():
            if budget == 0:
                break
            cap = self._spec_cap(seq, budget + n)
            if cap and self.block_manager.can_allocate(seq, n + cap):
                self.block_manager.allocate(seq, n + cap)
                scheduled[key] = (seq, n + cap)
                budget -= cap
        return budget

    def _spec_cap(self, seq: Sequence, budget: int) -> int:
        """Proposal slots for a decoding seq: what the budget leaves after its own token, and never
        more than the tokens it may still emit (the verify step adds one token of its own). None for a
        request whose params adjust its logits (SamplingParams.adjusts_logits)."""
        if not self.num_speculative_tokens or seq.num_uncomputed_tokens != 1 or seq.params.adjusts_logits:
            return 0
        remaining = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return max(0, min(self.num_speculative_tokens, budget - 1, remaining - 1))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.preempted = True
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- after the model ran ----
    def postprocess(self, batch: ScheduledBatch, sampled: list) -> list[Sequence]:
        """Advance each scheduled seq past its computed tokens and append what it sampled.

        sampled[i]: None or [] (prefill not finished yet), a token id, or a list of token ids: a
        speculative step's verified proposals followed by one token of the target's own. Tokens are
        checked one by one for EOS / stop token / length, and those after the one that ends the
        request are dropped. Returns the seqs that got a token."""
        advanced = []
        spec_caps = batch.spec_caps or [0] * len(batch)
        for seq, n, new, cap in zip(batch.seqs, batch.num_tokens, sampled, spec_caps, strict=True):
            tokens = [] if new is None else [new] if isinstance(new, int) else list(new)
            num_spec = len(seq.spec_token_ids)
            first_new = seq.num_tokens
            seq.token_ids.extend(tokens)  # before registering: verified proposals are computed tokens
            rejected = num_spec - (len(tokens) - 1) if num_spec else 0
            seq.spec_token_ids = []
            seq.spec_draft_probs = None
            seq.num_computed_tokens += n - rejected
            if cap:  # keep the slot of the next position (the new token); free the rejected / unused tail
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
            self.block_manager.register_computed_blocks(seq)
            if not tokens:
                continue
            advanced.append(seq)
            for i, token in enumerate(tokens):
                reason = self._stop_reason(seq, token, first_new + i + 1)
                if reason is not None:
                    del seq.token_ids[first_new + i + 1 :]
                    self.finish(seq, reason)
                    break
        return advanced

    def _stop_reason(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        """Why seq ends with `token` as its num_tokens-th token, or None to go on."""
        params = seq.params
        # a grammar's mask allows EOS only where the grammar ends: that ends the request (ignore_eos too)
        if token in self.eos_token_ids and (not params.ignore_eos or params.structured_outputs is not None):
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            return "stop"
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

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
