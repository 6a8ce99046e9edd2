"""OpenAI API request/response shapes for /v1/completions and /v1/chat/completions.

Requests are pydantic models: a field of the wrong type fails validation (-> 400 from app.py).
Responses are plain dicts built by the helpers at the bottom (they are serialized once, straight to
JSON, which keeps the streaming path cheap). Fields Kiln does not implement (presence/frequency
penalties, tools, ...) are accepted and ignored, as OpenAI clients send some of them by default.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The sampling/stopping fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1  # not in OpenAI's API; vLLM's extension
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension; benchmarks use it for fixed-length outputs
    user: str | None = None

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is text or token ids (one prompt per request).
    `logprobs`: None or the number of top alternatives per token (0..20)."""

    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text (OpenAI's list-of-parts form: the "text" parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `logprobs` is a bool; `top_logprobs` the alternatives per token."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = None


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
