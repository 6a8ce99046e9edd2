"""What the engine hands back: per-request outputs and engine-wide counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    token_ids: every output token so far (an EOS or stop token that ended the request included).
    text: the detokenized output so far; when a stop string matched, the text ends just before it.
        While the request runs, a tail that may begin a stop string is held back (it comes with a
        later output, or is dropped when the stop string completes), so the text never shrinks.
    finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens), "abort", or None.
    logprobs: None unless requested; else one dict per output token mapping token id -> logprob
        (natural log, of the model's unmodified distribution): the top-n alternatives plus the chosen token.
    prompt_logprobs: None unless SamplingParams.prompt_logprobs asked, and until the prompt has been
        computed; else one entry per prompt token: None for the first, then {token id: logprob} of the
        top-n alternatives and the prompt's own token, given the tokens before it (as vLLM's).
    With SamplingParams(output_kind="delta"), token_ids, text and logprobs hold only what is new since
    the request's previous output; with "final_only" the engine returns one output, when it finishes.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    # wall-clock times (time.perf_counter) for latency reporting
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class EngineStats:
    """Counters the server exports as metrics (totals are since the engine started)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV was reused
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # speculative decoding: tokens proposed, of those accepted by the target, and sequence-steps that
    # verified proposals (acceptance rate = accepted / proposed)
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    extra: dict = field(default_factory=dict)
