"""A tiny stand-in for LLMEngine's step API, for server tests that need no model: each step gives
every running request (at most max_num_seqs, in arrival order) one token, the next letter of
"abcdefghij..." as text (and, with logprobs, a table of the token, one alternative and one at -inf);
a sampled request's seed goes to a torch.Generator as in the real sampler; `fail_next_step` makes
one step raise (`die_next_step`: with an exception that ends the engine loop); `stop_at` ends
requests with finish_reason "stop" after that many tokens; `poisoned_prompts` (token-id tuples)
make every step that batches such a request raise a SamplingError naming it, before anything
advances, as the real sampler does for a seed it cannot use; `step_delay` slows steps down.
Outputs follow SamplingParams.output_kind as LLMEngine's do: cumulative, delta (only the new token)
or final_only (one output, at the end); `outputs` counts the outputs returned, `params` keeps every
request's SamplingParams. ScriptedTokenizer makes the outputs spell a given reply."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from kiln.engine.outputs import EngineStats, RequestOutput
from kiln.engine.sampler import SamplingError


class EngineLoopKiller(BaseException):
    """Past the engine loop's `except Exception`: what ends the loop thread (die_next_step)."""


class FakeTokenizer:
    eos_token_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        text.encode("utf-8")  # like a real (Rust) tokenizer, it takes only valid Unicode
        return [1 + ord(c) % 90 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + (i - 1) % 26) for i in ids if i)

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = True, tools=None, template_kwargs=None
    ) -> str:
        described = "".join(f"<tool>{t['function']['name']}" for t in tools or ())
        described += "".join(f"<{key}={value}>" for key, value in (template_kwargs or {}).items())
        return (
            described
            + "".join(f"<{m['role']}>{m['content']}" for m in messages)
            + ("<assistant>" if add_generation_prompt else "")
        )


class ScriptedTokenizer(FakeTokenizer):
    """FakeTokenizer whose token i (the engine's i-th output token, 1-based) reads as reply[i - 1]."""

    def __init__(self, reply: str):
        self.reply = reply

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.reply[i - 1] for i in ids if 0 < i <= len(self.reply))


class FakeEngine:
    def __init__(
        self, max_num_seqs: int = 4, max_model_len: int = 1024, step_delay: float = 0.005, tokenizer=None
    ):
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.tokenizer = tokenizer or FakeTokenizer()
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.fail_next_step = False
        self.die_next_step = False  # raise EngineLoopKiller: the engine loop thread dies
        self.poisoned_prompts: set[tuple[int, ...]] = set()
        self.requests: dict[str, dict] = {}  # insertion order = arrival order
        self.aborted: list[str] = []
        self.batches: list[list[str]] = []  # request ids of each step's batch
        self.thread_ids: set[int] = set()  # threads that called the engine
        self.outputs = 0
        self.params: list = []  # every added request's SamplingParams
        self.prompts: list[list[int]] = []  # and its prompt
        self.stop_at: int | None = None  # a request ends with "stop" after this many tokens

    def add_request(self, request_id, prompt, params) -> None:
        self.thread_ids.add(threading.get_ident())
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        self.params.append(params)
        self.prompts.append(list(prompt))
        self.requests[request_id] = {
            "prompt": list(prompt),
            "params": params,
            "tokens": [],
            "t0": time.perf_counter(),
            "generator": None,
            "sent": 0,  # tokens in earlier outputs (delta)
        }

    def abort_request(self, request_id) -> None:
        self.thread_ids.add(threading.get_ident())
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.step_delay)  # requests may arrive while this step "runs"
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected engine failure")
        if self.die_next_step:
            raise EngineLoopKiller("injected death of the engine loop")
        batch = list(self.requests)[: self.config.max_num_seqs]
        poisoned = {
            r: "poisoned" for r in batch if tuple(self.requests[r]["prompt"]) in self.poisoned_prompts
        }
        if poisoned:
            raise SamplingError(poisoned)
        for request_id in batch:  # what the sampler does with a seed (it raises on one out of range)
            req = self.requests[request_id]
            params = req["params"]
            if params.seed is not None and params.temperature > 0 and req["generator"] is None:
                req["generator"] = torch.Generator().manual_seed(params.seed)
        self.batches.append(batch)
        outputs = []
        now = time.perf_counter()
        for request_id in batch:
            req = self.requests[request_id]
            req["tokens"].append(len(req["tokens"]) + 1)
            req.setdefault("first", now)  # the first token's time
            if req["params"].logprobs is not None:  # the chosen token, one alternative, one ruled out
                token = req["tokens"][-1]
                table = {token: -0.25, token + 1: -1.5, token + 2: float("-inf")}
                req.setdefault("logprobs", []).append(table)
            stopped = self.stop_at is not None and len(req["tokens"]) >= self.stop_at
            done = stopped or len(req["tokens"]) >= req["params"].max_tokens
            if done:
                del self.requests[request_id]
            kind = req["params"].output_kind
            if kind == "final_only" and not done:
                continue
            first = req["sent"] if kind == "delta" else 0
            tokens = req["tokens"][first:]
            logprobs = req["logprobs"][first:] if "logprobs" in req else None
            req["sent"] = len(req["tokens"])
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=req["prompt"],
                    token_ids=tokens,
                    text=self.tokenizer.decode(tokens),
                    finished=done,
                    finish_reason=("stop" if stopped else "length") if done else None,
                    logprobs=logprobs,
                    arrival_time=req["t0"],
                    first_token_time=req["first"],
                    finished_time=now if done else None,
                )
            )
        self.outputs += len(outputs)
        return outputs

    def stats(self) -> EngineStats:
        running = min(len(self.requests), self.config.max_num_seqs)
        return EngineStats(
            num_running=running,
            num_waiting=len(self.requests) - running,
            kv_blocks_used=running,
            kv_blocks_total=16,
        )
