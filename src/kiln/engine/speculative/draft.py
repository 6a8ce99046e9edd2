"""Draft-model proposer: a smaller model with the target's tokenizer guesses k tokens, one at a time.

The draft has its own paged KV cache and BlockManager (no prefix caching), sized by
SpeculativeConfig.draft_num_kv_blocks (default: as many blocks as the target's cache, in the draft's
own, smaller, block bytes). Per target sequence it keeps a DraftState: the tokens whose KV it holds
and their block table. Each propose call first catches the draft up: its KV is kept only for the
longest prefix its tokens share with the sequence's (proposals the target rejected are dropped and
their blocks released), then the tokens it has not seen (the whole prompt the first time, else the
accepted proposals and the target's token) are computed in one flat batch, whose last logits give
the first proposal; k - 1 batched one-token steps give the rest. Greedy requests take the draft's
argmax; sampling ones draw from the draft's distribution with the request's own filters, and hand
that distribution (q) to the rejection sampler. A seeded request's proposal for output position t
uses the noise the target's own draw at t uses (Sampler.exponentials): the verify step accepts it
when the two draws agree, which shared noise makes likely when the draft is close to the target.
A row whose draft logits are not finite stops proposing (the target's step is not at fault).

When the draft's cache is short, states of sequences not in the step are evicted (they are
recomputed later), then sequences that still do not fit get no proposal this step. A sequence whose
proposals would reach past the draft's context (its max_position_embeddings, when shorter than the
target's) gets none either: the target carries on alone.
"""

from __future__ import annotations

import torch

from kiln.engine.block_manager import BlockManager
from kiln.engine.model_runner import ModelRunner
from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import ScheduledBatch
from kiln.engine.sequence import Sequence
from kiln.engine.speculative.config import SpeculativeConfig
from kiln.engine.speculative.proposal import Proposal


class DraftState:
    """What the draft model holds for one target sequence: the shape ModelRunner.prepare and
    BlockManager read (token_ids, num_computed_tokens, block_table, block_hashes, spec_token_ids)."""

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.spec_token_ids: list[int] = []
        self.prompt_logprobs = None  # the draft reports none
        self.prompt_logprobs_pending = False
        self.num_synced = 0  # token_ids[:num_synced] were copied from seq.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftProposer:
    """Proposes with `model` (a kiln model of the target's vocabulary) on its own paged KV cache."""

    def __init__(self, model, device: torch.device, num_blocks: int, block_size: int, max_model_len: int):
        self.runner = ModelRunner(model, device, num_blocks, block_size, 1, max_model_len, enforce_eager=True)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.states: dict[int, DraftState] = {}  # id(target seq) -> its draft state
        # positions the draft can compute: its RoPE cache ends at its max_position_embeddings
        self.max_positions = min(max_model_len, model.config.max_position_embeddings)

    @classmethod
    def for_engine(cls, config: SpeculativeConfig, engine) -> DraftProposer:
        """Load config.draft_model (a path, or an already loaded model: anything with .model) next to
        `engine`'s target; ValueError when the vocabularies differ."""
        draft = config.draft_model
        if isinstance(draft, str):
            from kiln.loaders import load_model

            draft = load_model(
                draft,
                device=str(engine.device),
                dtype=engine.config.dtype,
                cpu_format=engine.config.cpu_format,
                lm_head_format=engine.config.lm_head_format,
            )
        model = draft.model
        target_vocab = engine.model.config.vocab_size
        if model.config.vocab_size != target_vocab:
            raise ValueError(
                f"SpeculativeConfig: draft_model has a vocabulary of {model.config.vocab_size} tokens, the "
                f"target {target_vocab}; the draft must share the target's tokenizer"
            )
        num_blocks = config.draft_num_kv_blocks or engine.block_manager.num_blocks
        return cls(model, engine.device, num_blocks, engine.config.block_size, engine.max_model_len)

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    def propose(self, seqs: list[Sequence], max_tokens: list[int], sampler: Sampler) -> list[Proposal]:
        """Per seq max_tokens[i] proposed tokens (none for a seq the draft cache cannot hold now)."""
        self._drop_finished()
        sampler.check_seeds(seqs)
        states = [self._catch_up(seq, k, seqs) for seq, k in zip(seqs, max_tokens, strict=True)]
        active = [i for i, state in enumerate(states) if state is not None]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        step = 0
        while active:
            batch_states = [states[i] for i in active]
            num_new = [s.num_tokens - s.num_computed_tokens for s in batch_states]
            logits = self.runner.execute(self.runner.prepare(ScheduledBatch(batch_states, num_new))[0])
            for state in batch_states:
                state.num_computed_tokens = state.num_tokens
            finite = torch.isfinite(logits.amax(dim=-1)).tolist()
            if not all(finite):
                logits = logits[[row for row, ok in enumerate(finite) if ok]]
                active = [i for i, ok in zip(active, finite, strict=True) if ok]
                if not active:
                    break
            positions = [seqs[i].num_output_tokens + step for i in active]
            drawn, q = self._draw(logits, [seqs[i] for i in active], positions, sampler)
            for row, i in enumerate(active):
                state = states[i]
                state.token_ids.append(drawn[row])
                tokens[i].append(drawn[row])
                if q is not None:
                    probs[i].append(q[row])
            step += 1
            active = [i for i in active if max_tokens[i] > step]
        proposals = []
        for i, seq in enumerate(seqs):
            sampled = bool(probs[i]) and not seq.params.greedy
            proposals.append(Proposal(tokens[i], torch.stack(probs[i]) if sampled else None))
        return proposals

    def _catch_up(self, seq: Sequence, k: int, batch: list[Sequence]) -> DraftState | None:
        """seq's draft state, its KV cut back to the prefix it shares with seq.token_ids and its blocks
        grown for the tokens to compute; None when the draft cache cannot hold them."""
        if seq.num_tokens + k - 1 > self.max_positions:  # the last proposal's input position would not fit
            if id(seq) in self.states:
                self._free(id(seq))
            return None
        state = self.states.get(id(seq))
        if state is None:
            state = self.states[id(seq)] = DraftState(seq)
        # tokens copied at the last call still match (a sequence only grows); compare the draft's
        # proposals after them; at least the last token is always recomputed (its logits propose)
        limit = min(state.num_computed_tokens, seq.num_tokens - 1)
        valid = min(state.num_synced, limit)
        while valid < limit and state.token_ids[valid] == seq.token_ids[valid]:
            valid += 1
        state.num_computed_tokens = valid
        self.block_manager.trim(state, valid)
        state.token_ids = list(seq.token_ids)
        state.num_synced = seq.num_tokens
        # positions computed this call: the unseen tokens, then all but the last proposal
        needed = state.num_tokens - valid + k - 1
        if not self.block_manager.can_allocate(state, needed):
            in_step = {id(s) for s in batch}
            for key in [key for key in self.states if key not in in_step]:
                self._free(key)
                if self.block_manager.can_allocate(state, needed):
                    break
        if not self.block_manager.can_allocate(state, needed):
            return None
        self.block_manager.allocate(state, needed)
        return state

    def _draw(
        self, logits: torch.Tensor, seqs: list[Sequence], positions: list[int], sampler: Sampler
    ) -> tuple[list[int], torch.Tensor | None]:
        """One proposal per row of logits [B, V], for seqs[i]'s output position positions[i]: argmax
        for greedy requests, else a draw from the request's filtered distribution q (returned, float32
        [B, V]) with Sampler.exponentials' noise for that position."""
        if all(seq.params.greedy for seq in seqs):
            return logits.argmax(dim=-1).tolist(), None
        q = sampler.probs(logits, [seq.params for seq in seqs])
        for row, seq in enumerate(seqs):
            if seq.params.greedy:
                q[row] = torch.nn.functional.one_hot(logits[row].argmax(), q.shape[1]).float()
        noise = sampler.exponentials(seqs, positions, q.shape[1])
        return (q / noise).argmax(dim=-1).tolist(), q

    def release_finished(self) -> None:
        """Free the draft blocks of sequences that have finished (the engine calls it after a step)."""
        self._drop_finished()

    def _drop_finished(self) -> None:
        for key in [key for key, state in self.states.items() if state.seq.is_finished]:
            self._free(key)

    def _free(self, key: int) -> None:
        self.block_manager.free(self.states.pop(key))
