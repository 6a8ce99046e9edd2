"""OpenAI API request/response shapes for /v1/completions and /v1/chat/completions.

Requests are pydantic models with strict types: a field of the wrong type (JSON `true` for an integer,
`"2"` for a number), out of its range, or text that is not valid Unicode fails validation (-> 400 from
app.py, `param` naming the field).
Responses are plain dicts built by the helpers at the bottom (they are serialized once, straight to
JSON, which keeps the streaming path cheap). Fields Kiln does not implement (presence/frequency
penalties, tools, ...) are accepted and ignored, as OpenAI clients send some of them by default.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    field_validator,
)

from kiln.engine.sampling_params import SEED_MAX, SEED_MIN

MAX_STOP_STRINGS = 16  # each is searched for after every token: a long list slows the whole batch
MAX_STOP_CHARS = 512  # each; a stream holds back and rechecks up to this many characters a token


def _valid_text(text: str) -> str:
    """JSON allows lone surrogates ("\\ud800"), which are not Unicode text: no tokenizer takes them."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"contains a lone surrogate ({text[exc.start]!r} at character {exc.start}), not valid Unicode"
            ) from None
    return text


# Strict types: JSON true is not 1, "2" is not 2 (a float field still takes a JSON integer).
Text = Annotated[str, AfterValidator(_valid_text)]
Float = Annotated[float, Strict()]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# field -> (whether a value changes nothing, what to send instead)
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (lambda v: not any(v.values()), "an empty map (or only zero biases)"),
    "presence_penalty": (lambda v: v == 0, "0"),
    "frequency_penalty": (lambda v: v == 0, "0"),
    "repetition_penalty": (lambda v: v == 1, "1"),
    "min_tokens": (lambda v: v == 0, "0"),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}'),
    "tools": (lambda v: not v, "an empty list"),
    "tool_choice": (lambda v: v in ("none", "auto"), '"none" or "auto" (there are no tools)'),
    "functions": (lambda v: not v, "an empty list"),
    "function_call": (lambda v: v in ("none", "auto"), '"none" or "auto" (there are no functions)'),
    "suffix": (lambda v: v == "", "an empty string"),
}


def _neutral_or_refused(name: str, value):
    neutral, accepted = UNSUPPORTED[name]
    if value is not None and not neutral(value):
        raise ValueError(f"not supported by this server; leave it out or send {accepted}")
    return value


class _SamplingFields(BaseModel):
    """The sampling/stopping fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: Text
    max_tokens: StrictInt | None = None
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = -1  # not in OpenAI's API; vLLM's extension: -1 (off) or >= 1
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension; benchmarks use it for fixed-length outputs
    user: Text | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_on_or_off(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("expected -1 (no top-k filter) or an integer >= 1")
        return value

    # OpenAI / vLLM fields this server does not implement: each accepted only at a value that changes
    # nothing (UNSUPPORTED), a 400 naming it otherwise, as answering them while ignoring them would
    # answer another request than the one sent. Other unknown fields are let through (extra="allow").
    logit_bias: dict[str, Any] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator(*(name for name in UNSUPPORTED if name != "suffix"))
    @classmethod
    def _neutral_or_refused(cls, value, info):
        return _neutral_or_refused(info.field_name, value)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        # a stream checks each new token's text against every stop string: bounded work a token
        for stop in [value] if isinstance(value, str) else value or []:
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(stop)}")
        return value

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is text or token ids (one prompt per request), or a list of texts.
    `logprobs`: None or the number of top alternatives per token (0..20)."""

    prompt: Text | list[StrictInt] | list[Text]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = None  # generated server-side, n of them returned: only best_of == n
    suffix: Text | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        return _neutral_or_refused("suffix", value)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info):
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"best_of {value} is not supported by this server; leave it out or send n ({n})")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_are_text(cls, value):
        # only text: a part of another type (an image, audio, a file) would be dropped, and the model
        # would answer a message other than the one sent
        if isinstance(value, list):
            for j, part in enumerate(value):
                if part.get("type") != "text":
                    raise ValueError(
                        f"part {j} has type {part.get('type')!r}: this server's models take only parts of"
                        " type 'text'"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {j} of type 'text' needs a string 'text'")
                _valid_text(part["text"])
        return value

    def text(self) -> str:
        """The message's text (OpenAI's list-of-parts form, all of type "text": their texts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `logprobs` is a bool; `top_logprobs` the alternatives per token
    (OpenAI's rule: only with logprobs true)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: StrictInt | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value


# every field name of the request models: what an error's `param` may name (pydantic's error locations
# also hold union-member tags such as "list[int]", which are not parameters)
FIELD_NAMES = frozenset(
    name
    for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, StreamOptions)
    for name in model.model_fields
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(entries: list[tuple[int, str, float, list[tuple[str, float]]]], offset0: int) -> dict:
    """The completions API's logprobs object from (token_id, token_text, logprob, top[(text, lp)])
    tuples; text offsets count characters from `offset0`."""
    offsets, pos = [], offset0
    for _, text, _, _ in entries:
        offsets.append(pos)
        pos += len(text)
    return {
        "tokens": [e[1] for e in entries],
        "token_logprobs": [e[2] for e in entries],
        "top_logprobs": [dict(e[3]) for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[tuple[int, str, float, list[tuple[str, float]]]]) -> dict:
    """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {
        "content": [
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))} for t, v in top
                ],
            }
            for _, text, lp, top in entries
        ]
    }


def completion_response(request_id: str, model: str, choices: list[dict], usage_: dict, chat: bool) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def stream_chunk(
    request_id: str, model: str, choices: list[dict], chat: bool, usage_: dict | None = None
) -> dict:
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk
