"""LLMEngine: the step-level API (add requests, step, collect outputs) the LLM class and the server drive.

One step = schedule -> model runner (one flat batch) -> sampler -> append tokens, detokenize,
check stops -> RequestOutputs for the requests that advanced.

With speculative decoding (EngineConfig.speculative) a proposer fills the proposal slots the
scheduler gave decoding sequences before the model runs; the runner verifies them in the same
forward pass, so a step can append several tokens to a request; they are detokenized and checked
for stop strings one at a time, and those after a stop are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kiln.engine.block_manager import BlockManager
from kiln.engine.config import EngineConfig, exact_kv_layout_for, kv_cache_dtype_for, num_kv_blocks_for_model
from kiln.engine.detokenizer import IncrementalDetokenizer, stop_prefix_length
from kiln.engine.exact_kv import ExactBlockPool
from kiln.engine.kv_scales import engine_kv_calibration
from kiln.engine.logits_processors import bad_words_token_ids
from kiln.engine.model_runner import ModelInputs, ModelRunner
from kiln.engine.outputs import EngineStats, RequestOutput
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import ScheduledBatch, Scheduler
from kiln.engine.sequence import Sequence
from kiln.engine.structured_outputs import StructuredOutputs


class LLMEngine:
    """The engine. `loaded` (a kiln.loaders LoadedModel: .model, .tokenizer, .config) skips loading
    config.model, so several engines can share one loaded model (its weights are read-only).
    `before_forward` is the model runner's hook (see ModelRunner; tensor parallelism's rank 0 passes
    its broadcast of each step's inputs). `runner_class` builds the runner with ModelRunner's
    arguments (pipeline parallelism passes its stage runner)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded=None,
        *,
        before_forward: Callable[[ModelInputs], None] | None = None,
        runner_class: Callable[..., ModelRunner] = ModelRunner,
    ):
        self.config = config = config or EngineConfig()
        self.device = config.resolved_device()
        if loaded is None:
            from kiln.loaders import load_model

            loaded = load_model(
                config.model,
                device=str(self.device),
                dtype=config.dtype,
                cpu_format=config.cpu_format,
                lm_head_format=config.lm_head_format,
                expert_format=config.expert_format,
            )
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        model_config = self.model.config
        num_blocks = num_kv_blocks_for_model(config, self.device, self.model)
        # a single request must always fit the whole cache, else preemption could never make room
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        eos = list(getattr(self.tokenizer, "eos_token_ids", None) or model_config.eos_token_ids or [])
        self.eos_token_ids = eos
        # the grammar compiler of structured-outputs requests (xgrammar's view of the tokenizer is built
        # when the first such request comes)
        self.structured_outputs = StructuredOutputs(self.tokenizer, model_config.vocab_size, eos)
        kv_cache_dtype = kv_cache_dtype_for(config, self.model)
        exact_kv = exact_kv_layout_for(config, kv_cache_dtype)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            exact=None if exact_kv is None else ExactBlockPool(exact_kv, config.block_size),
        )
        spec = config.speculative
        self.scheduler = self.new_scheduler(config.max_num_seqs)
        # one process or tensor parallelism (whose workers calibrate at the same point); not a pipeline
        kv_calibration = engine_kv_calibration(
            config,
            self.model,
            self.tokenizer,
            kv_cache_dtype,
            pipeline=runner_class is not ModelRunner,
            checkpoint_scales=loaded.kv_scales,
        )
        self.runner = runner_class(
            self.model,
            self.device,
            num_blocks,
            config.block_size,
            config.max_num_seqs,
            self.max_model_len,
            enforce_eager=config.enforce_eager,
            compile_cpu_decode=config.compile_cpu_decode,
            seed=config.seed,
            before_forward=before_forward,
            kv_cache_dtype=kv_cache_dtype,
            kv_calibration=kv_calibration,
            exact_kv=exact_kv,
        )
        # per-phase wall time of every step (kiln.engine.step_times); the runner adds its phases
        self.step_times = self.runner.step_times
        self.proposer = None
        if spec is not None:
            from kiln.engine.speculative import make_proposer

            self.proposer = make_proposer(spec, self)
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_verify_steps = 0  # sequence-steps that verified at least one proposal
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def new_scheduler(self, max_num_seqs: int) -> Scheduler:
        """A Scheduler over this engine's block manager, token budget, max_model_len and EOS ids."""
        spec = self.config.speculative
        return Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.config.token_budget(self.device),
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        )

    # ---- requests ----
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Raises ValueError for a duplicate id, an empty prompt, a prompt plus
        max_tokens longer than max_model_len, a token id outside the vocabulary (logit_bias,
        allowed_token_ids, stop_token_ids, bad words), or a structured-outputs constraint that cannot be
        compiled; nothing is queued then."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"add_request: request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("add_request: the prompt is empty; give at least one token")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"add_request: prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"add_request: prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            outside = [t for t in (getattr(params, name) or ()) if t >= vocab]
            if outside:
                raise ValueError(f"add_request: {name} token id {outside[0]} is not in [0, {vocab})")
        seq = Sequence(request_id, prompt_ids, params)
        if params.bad_words:
            seq.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words, vocab)
        if params.min_tokens:
            stops = ([] if params.ignore_eos else self.eos_token_ids) + (params.stop_token_ids or [])
            seq.min_tokens_stop_ids = sorted({t for t in stops if t < vocab})
            if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= set(stops):
                raise ValueError(
                    "add_request: every token of allowed_token_ids is EOS or a stop token, which min_tokens "
                    "bans: no token could be sampled"
                )
        if params.structured_outputs is not None:
            seq.grammar = self.structured_outputs.new_state(params.structured_outputs)
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output
        )
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.prompt_tokens_total += len(prompt_ids)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; the next step() reports it with finish_reason "abort"."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, "abort")
        seq.finished_time = time.perf_counter()
        self._aborted.append(seq)
        if self.proposer is not None:  # its draft KV too (else held until the next step with a batch)
            self.proposer.release_finished()

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to do: requests running or waiting, or aborts not yet reported."""
        return bool(self._aborted) or self.scheduler.has_unfinished()

    # ---- stepping ----
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return outputs of the requests that got a token or finished (the
        aborted ones first; a step that raises keeps them for the next)."""
        return self._after_aborts(self._step)

    def _after_aborts(self, step: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        """The outputs of the aborts pending, then step()'s; if step raises, the aborts stay pending."""
        aborted, self._aborted = self._aborted, []
        try:
            outputs = step()
        except BaseException:
            self._aborted = aborted + self._aborted
            raise
        return [self._output(seq) for seq in aborted] + outputs

    def _step(self) -> list[RequestOutput]:
        clock = time.perf_counter
        start = clock()
        batch = self.scheduler.schedule()
        times = self.step_times
        times.steps += 1
        scheduled = clock()
        times.add("schedule", scheduled - start)
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                # can't happen while add_request caps prompt + max_tokens at what the cache holds
                raise RuntimeError("LLMEngine: the next waiting request does not fit the empty KV cache")
            return []
        if self.proposer is not None:
            self._propose(batch)
        tokens, logprobs = self.runner.run(batch)
        return self._advance(self.scheduler, batch, tokens, logprobs)

    def _advance(self, scheduler, batch, tokens: list, logprobs: list) -> list[RequestOutput]:
        """After a step ran: `scheduler` (the one that scheduled `batch`) advances its sequences by
        the sampled `tokens`, which are detokenized; the outputs of the requests that got a token or
        finished. A sequence aborted while its step was in flight (a pipeline's) is skipped."""
        clock, times = time.perf_counter, self.step_times
        if any(seq.is_finished for seq in batch.seqs):
            keep = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
            batch = ScheduledBatch(
                [batch.seqs[i] for i in keep],
                [batch.num_tokens[i] for i in keep],
                [batch.spec_caps[i] for i in keep] if batch.spec_caps else [],
            )
            tokens, logprobs = [tokens[i] for i in keep], [logprobs[i] for i in keep]
        num_before = [seq.num_tokens for seq in batch.seqs]
        for seq, new in zip(batch.seqs, tokens, strict=True):
            if seq.spec_token_ids:
                self.spec_verify_steps += 1
                self.spec_accepted_tokens += len(new) - 1
        ran = clock()
        advanced = scheduler.postprocess(batch, tokens)
        now = clock()
        times.add("postprocess", now - ran)
        outputs = []
        new_logprobs = {id(seq): lp for seq, lp in zip(batch.seqs, logprobs, strict=True)}
        first_new = {id(seq): n for seq, n in zip(batch.seqs, num_before, strict=True)}
        for seq in advanced:
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._emit(seq, first_new[id(seq)], new_logprobs[id(seq)])
            if seq.is_finished:
                seq.finished_time = now
                self.requests.pop(seq.request_id, None)
            if seq.is_finished or seq.params.output_kind != "final_only":
                outputs.append(self._output(seq))
        if self.proposer is not None:
            self.proposer.release_finished()
        times.add("detokenize", clock() - now)
        return outputs

    def _propose(self, batch) -> None:
        """Fill the proposal slots the scheduler gave (batch.spec_caps) and shrink the batch to them."""
        for seq in batch.seqs:  # a step that raised may have left the last proposals behind
            seq.spec_token_ids = []
            seq.spec_draft_probs = None
        slots = [i for i, cap in enumerate(batch.spec_caps) if cap]
        if not slots:
            return
        seqs = [batch.seqs[i] for i in slots]
        proposals = self.proposer.propose(seqs, [batch.spec_caps[i] for i in slots], self.runner.sampler)
        for i, seq, proposal in zip(slots, seqs, proposals, strict=True):
            seq.spec_token_ids = list(proposal.token_ids)
            seq.spec_draft_probs = proposal.draft_probs
            batch.num_tokens[i] = seq.num_uncomputed_tokens + len(seq.spec_token_ids)
            self.spec_proposed_tokens += len(seq.spec_token_ids)

    def _emit(self, seq: Sequence, first_new: int, logprobs: list | None) -> None:
        """Detokenize seq's tokens from index first_new on, one at a time; a stop string ends the
        request at the token that completed it and drops the tokens after it."""
        new = seq.token_ids[first_new:]
        for i, token in enumerate(new):
            last = i == len(new) - 1
            if seq.params.min_tokens:  # stop strings count from the min_tokens-th output token on
                number = first_new + i + 1 - seq.num_prompt_tokens
                seq.detokenizer.search_stops = number >= seq.params.min_tokens
            self.generation_tokens_total += 1
            if logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            if last and seq.finish_reason == "stop":  # ended by EOS or a stop token, which are not text
                seq.detokenizer.add_tokens([], final=True)
            elif seq.detokenizer.add_tokens([token], final=last and seq.is_finished):
                del seq.token_ids[first_new + i + 1 :]
                if seq.is_finished:  # ended by max_tokens (or EOS) further on: the stop string wins
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
                return

    def _output(self, seq: Sequence) -> RequestOutput:
        """seq's output as its params.output_kind asks: all of it, or (delta) what is new since the last."""
        text = seq.detokenizer.text
        if not seq.is_finished:  # hold back what may start a stop string: text never shrinks
            text = text[: len(text) - stop_prefix_length(text, seq.params.stop)]
        first_token = 0
        # prompt logprobs once all are taken (they are not changed after): in every cumulative output,
        # in the first delta
        prompt_logprobs = None if seq.prompt_logprobs_pending else seq.prompt_logprobs
        if seq.params.output_kind == "delta":
            first_token, first_char = seq.sent_tokens, seq.sent_chars
            seq.sent_tokens, seq.sent_chars = seq.num_output_tokens, max(first_char, len(text))
            text = text[first_char:]
            if seq.sent_prompt_logprobs:
                prompt_logprobs = None
            seq.sent_prompt_logprobs |= prompt_logprobs is not None
        logprobs = seq.logprobs
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.token_ids[seq.num_prompt_tokens + first_token :],
            text=text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            logprobs=logprobs[first_token:] if logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finished_time=seq.finished_time,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_proposed_tokens=self.spec_proposed_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_verify_steps=self.spec_verify_steps,
        )
