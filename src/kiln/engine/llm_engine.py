"""LLMEngine: the step-level API (add requests, step, collect outputs) the LLM class and the server drive.

One step = schedule -> model runner (one flat batch) -> sampler -> append tokens, detokenize,
check stops -> RequestOutputs for the requests that advanced.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kiln.engine.block_manager import BlockManager
from kiln.engine.config import EngineConfig, num_kv_blocks_for_model
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.model_runner import ModelInputs, ModelRunner
from kiln.engine.outputs import EngineStats, RequestOutput
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Sequence


class LLMEngine:
    """The engine. `loaded` (a kiln.loaders LoadedModel: .model, .tokenizer, .config) skips loading
    config.model, so several engines can share one loaded model (its weights are read-only).
    `before_forward` is the model runner's hook (see ModelRunner; tensor parallelism's rank 0 passes
    its broadcast of each step's inputs)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded=None,
        *,
        before_forward: Callable[[ModelInputs], None] | None = None,
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
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.token_budget(self.device),
            max_model_len=self.max_model_len,
            eos_token_ids=eos,
        )
        self.runner = ModelRunner(
            self.model,
            self.device,
            num_blocks,
            config.block_size,
            config.max_num_seqs,
            self.max_model_len,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            before_forward=before_forward,
        )
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- requests ----
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Raises ValueError for a duplicate id, an empty prompt, or a prompt plus
        max_tokens longer than max_model_len."""
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
        seq = Sequence(request_id, prompt_ids, params)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ----
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return outputs of the requests that got a token or finished."""
        outputs = [self._output(seq) for seq in self._aborted]
        self._aborted.clear()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running:
                # can't happen while add_request caps prompt + max_tokens at what the cache holds
                raise RuntimeError("LLMEngine: the next waiting request does not fit the empty KV cache")
            return outputs
        tokens, logprobs = self.runner.run(batch)
        for seq, lp in zip(batch.seqs, logprobs, strict=True):
            if lp is not None:
                seq.logprobs.append(lp)
        advanced = self.scheduler.postprocess(batch, tokens)
        now = time.perf_counter()
        for seq in advanced:
            self.generation_tokens_total += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.finish_reason == "stop":  # ended by EOS or a stop token, which are not text
                seq.detokenizer.add_tokens([], final=True)
            elif seq.detokenizer.add_tokens([seq.token_ids[-1]], final=seq.is_finished):
                if seq.is_finished:  # hit max_tokens with the same token: the stop string wins
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")
            if seq.is_finished:
                seq.finished_time = now
                self.requests.pop(seq.request_id, None)
            outputs.append(self._output(seq))
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.detokenizer.text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
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
        )
