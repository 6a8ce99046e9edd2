"""OpenAI completions and chat completions on top of AsyncEngine: request -> engine sub-requests
(one per prompt x choice), then the engine outputs -> a JSON response or a server-sent-event stream.

Validation that needs the model happens here, before anything reaches the engine, as APIError(400):
the cheap checks (model name, whether the request's sequences could ever fit) before tokenizing, the
rest (context length, empty prompt, token ids in the vocabulary) after. Tokenization and the final
response's detokenization run on a small thread pool, never on the event loop, so a long prompt
stalls neither /health nor the streams; after a large prompt the freed memory is handed back to the
OS. Greedy choices are what `kiln.LLM.generate` returns for the same token ids: the server adds
nothing to the prompt but the chat template. In chat messages, text that looks like a special token
(`<|im_start|>`) is tokenized as text, unless the app allows special tokens in content.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from jinja2.exceptions import TemplateError

from kiln.engine.detokenizer import stop_prefix_length
from kiln.engine.sampling_params import SamplingParams
from kiln.server import protocol
from kiln.server.async_engine import AsyncEngine, SubRequest

# prompts of at least this many characters (in one request) are followed by a malloc_trim: the
# tokenizer's transient buffers (~80 bytes a character) would otherwise stay in the process's RSS
_LARGE_PROMPT_CHARS = 1 << 20


class APIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return protocol.error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class OpenAIServing:
    """Turns validated protocol requests into engine work and engine outputs into OpenAI responses."""

    def __init__(
        self, async_engine: AsyncEngine, model_name: str, allow_special_tokens_in_chat: bool = False
    ):
        self.async_engine = async_engine
        self.engine = async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name
        self.max_model_len = int(self.engine.max_model_len)
        self.allow_special_tokens_in_chat = allow_special_tokens_in_chat
        self.executor: ThreadPoolExecutor | None = None
        self.start()

    def start(self) -> None:
        """(Re)start the tokenizer threads: the app's lifespan stops them, and may start again."""
        if self.executor is None:
            # two threads: a long prompt being tokenized leaves one for everybody else
            self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-tokenize")

    def stop(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on the tokenizer threads (the event loop keeps serving meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args))

    # ---- cheap checks, before tokenizing ----
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                400,
                f"model {model!r} is not served here; use {self.model_name!r} (GET /v1/models)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_fits(self, num_prompts: int, n: int) -> None:
        """A request of more sequences than the server ever holds at once can never run: 400 (not the
        503 "retry later" of a full queue)."""
        capacity = self.async_engine.capacity
        if num_prompts * n > capacity:
            raise bad_request(
                f"the request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}); this "
                f"server runs at most {capacity} at once (running + queued): send fewer prompts or a "
                "smaller n",
                "n" if n > 1 else "prompt",
                "too_many_sequences",
            )

    @staticmethod
    def prompt_texts(req: protocol.CompletionRequest) -> list[str] | list[list[int]]:
        """The prompts of a completion request, as texts, or as one list of token ids."""
        prompt = req.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if not prompt:
            raise bad_request(
                "prompt is empty; give a string, a list of strings or a list of token ids", "prompt"
            )
        return list(prompt)

    # ---- tokenization (on the tokenizer threads) ----
    async def completion_prompts(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        if prompts and not isinstance(prompts[0], str):
            return prompts
        return await self.off_loop(self._encode_texts, prompts)

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        try:
            ids = [self.tokenizer.encode(t, add_special_tokens=True) for t in texts]
        except ValueError as exc:  # a tokenizer that refuses a text (the random models' "<id>" syntax)
            raise bad_request(f"prompt: {exc}", "prompt") from exc
        if sum(map(len, texts)) >= _LARGE_PROMPT_CHARS:
            release_freed_memory()
        return ids

    async def chat_prompt(self, req: protocol.ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        return await self.off_loop(self._encode_chat, messages)

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        encode_chat = getattr(self.tokenizer, "encode_chat", None)
        try:
            if encode_chat is not None:  # kiln's Tokenizer: content text is never a special token
                ids = encode_chat(
                    messages,
                    add_generation_prompt=True,
                    special_tokens_in_content=self.allow_special_tokens_in_chat,
                )
            else:  # tokenizers without that (random-weight models): plain template + encode
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                # the template writes its own special tokens; don't let encode add a second BOS
                ids = self.tokenizer.encode(text, add_special_tokens=False)
        except ValueError as exc:  # the template raises on conversations it does not accept
            raise bad_request(f"messages: {exc}", "messages") from exc
        except TemplateError as exc:  # the template's raise_exception, an undefined variable, ...
            raise bad_request(f"messages: the chat template rejected them: {exc}", "messages") from exc
        if sum(len(m["content"]) for m in messages) >= _LARGE_PROMPT_CHARS:
            release_freed_memory()
        return ids

    # ---- request -> sub-requests ----
    def build(self, req, prompts: list[list[int]], max_tokens: int | None, logprobs: int | None, tag: str):
        """Sub-requests for every prompt x choice; validates lengths and sampling fields (400 on error)."""
        subs = []
        for p, prompt_ids in enumerate(prompts):
            if not prompt_ids:
                raise bad_request("prompt is empty after tokenization", "prompt")
            room = self.max_model_len - len(prompt_ids)
            tokens = room if max_tokens is None else max_tokens
            if tokens < 1 or len(prompt_ids) + tokens > self.max_model_len:
                raise bad_request(
                    f"this model's context length is {self.max_model_len} tokens; the prompt has "
                    f"{len(prompt_ids)} and max_tokens asks for {tokens}: shorten the prompt or lower "
                    "max_tokens",
                    "max_tokens" if max_tokens is not None and room > 0 else "prompt",
                    "context_length_exceeded",
                )
            vocab = getattr(getattr(self.engine, "model", None), "config", None)
            vocab = getattr(vocab, "vocab_size", None)
            if vocab is not None and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
            for i in range(req.n):
                try:
                    params = SamplingParams(
                        max_tokens=tokens,
                        temperature=req.temperature,
                        top_p=req.top_p,
                        top_k=req.top_k,
                        min_p=req.min_p,
                        # distinct seeds, else n seeded choices would all be the same sample; modulo
                        # 2**64 stays in the generator's range (it reads a negative seed the same way)
                        seed=None if req.seed is None else (req.seed + i) % 2**64,
                        stop=req.stop_list(),
                        ignore_eos=req.ignore_eos,
                        logprobs=logprobs,
                    )
                except ValueError as exc:  # protocol.py checked the fields first: a backstop
                    raise bad_request(str(exc), None, "invalid_value") from exc
                subs.append(SubRequest(f"{tag}-{p}-{i}", prompt_ids, params, index=p * req.n + i))
        return subs

    # ---- outputs -> responses ----
    def logprob_entries(
        self, out, start: int, top_n: int
    ) -> list[tuple[int, str, float, list[tuple[str, float]]]]:
        """(token id, token text, logprob, top alternatives) for output tokens [start:]."""
        if out.logprobs is None:
            return []
        entries = []
        for token_id, table in zip(out.token_ids[start:], out.logprobs[start:], strict=False):
            top = sorted(table.items(), key=lambda kv: -kv[1])[:top_n]
            entries.append(
                (
                    token_id,
                    self._token_text(token_id),
                    float(table.get(token_id, float("-inf"))),
                    [(self._token_text(t), float(v)) for t, v in top],
                )
            )
        return entries

    def final_response(
        self,
        request_id: str,
        finals: list,
        chat: bool,
        top_n: int | None,
        prompt_tokens: int,
        echo_texts: list[str] | None = None,
    ) -> dict:
        """The non-streaming response body from each choice's final RequestOutput."""
        choices = []
        for index, out in enumerate(finals):
            entries = self.logprob_entries(out, 0, top_n) if top_n is not None else None
            if chat:
                logprobs = protocol.chat_logprobs(entries) if entries is not None else None
                message = {"role": "assistant", "content": out.text}
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason,
                    }
                )
            else:
                echo = echo_texts[index] if echo_texts else ""
                logprobs = protocol.completion_logprobs(entries, len(echo)) if entries is not None else None
                choices.append(
                    {
                        "index": index,
                        "text": echo + out.text,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason,
                    }
                )
        completion_tokens = sum(len(o.token_ids) for o in finals)
        usage = protocol.usage(prompt_tokens, completion_tokens)
        return protocol.completion_response(request_id, self.model_name, choices, usage, chat)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def release_freed_memory() -> None:
    """Give the memory freed after a large request back to the OS (glibc's malloc_trim; a no-op
    elsewhere). Without it a 20 MB prompt left the process ~2 GB larger for good."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


async def collect(queue: asyncio.Queue, count: int) -> list:
    """Wait until all `count` choices finished; returns their final outputs by choice index."""
    finals: list = [None] * count
    remaining = count
    while remaining:
        index, item = await queue.get()
        if isinstance(item, Exception):
            raise item
        if item.finished:
            finals[index] = item
            remaining -= 1
    return finals


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream_events(
    serving: OpenAIServing,
    queue: asyncio.Queue,
    count: int,
    request_id: str,
    chat: bool,
    top_n: int | None,
    prompt_tokens: int,
    include_usage: bool,
    echo_texts: list[str] | None = None,
    stops: list[list[str] | None] | None = None,
) -> AsyncIterator[str]:
    """The SSE stream: text deltas per choice as tokens arrive, a finish chunk per choice, optional
    usage chunk, then `data: [DONE]`. An engine failure becomes an error event before [DONE].
    stops[i]: choice i's stop strings; text that may begin one is held back until it is ruled out (or
    cut with the match), so the streamed text is the non-streamed one."""
    model = serving.model_name
    sent_chars = [0] * count
    sent_tokens = [0] * count
    # completions' text_offset: counted from the echoed prompt, as the non-streamed response counts
    text_offsets = [len(echo_texts[i]) if echo_texts else 0 for i in range(count)]
    completion_tokens = 0
    if chat:
        first = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(count)
        ]
        yield sse(protocol.stream_chunk(request_id, model, first, chat=True))
    elif echo_texts:
        echoed = [
            {"index": i, "text": echo_texts[i], "logprobs": None, "finish_reason": None} for i in range(count)
        ]
        yield sse(protocol.stream_chunk(request_id, model, echoed, chat=False))
    remaining = count
    while remaining:
        index, item = await queue.get()
        if isinstance(item, Exception):
            yield sse(protocol.error_body(str(item), "server_error", None, "engine_error"))
            break
        text = item.text
        if not item.finished:
            text = text[: len(text) - stop_prefix_length(text, stops[index] if stops else None)]
        delta = text[sent_chars[index] :]
        logprobs = None
        if top_n is not None:
            entries = serving.logprob_entries(item, sent_tokens[index], top_n)
            if chat:
                logprobs = protocol.chat_logprobs(entries)
            else:
                logprobs = protocol.completion_logprobs(entries, text_offsets[index])
                text_offsets[index] += sum(len(entry[1]) for entry in entries)
        sent_chars[index] = max(sent_chars[index], len(text))
        sent_tokens[index] = len(item.token_ids)
        finish = item.finish_reason if item.finished else None
        if not (delta or finish or logprobs):
            continue
        if chat:
            choice = {
                "index": index,
                "delta": {"content": delta} if delta else {},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        yield sse(protocol.stream_chunk(request_id, model, [choice], chat))
        if item.finished:
            remaining -= 1
            completion_tokens += len(item.token_ids)
    else:
        if include_usage:
            usage = protocol.usage(prompt_tokens, completion_tokens)
            yield sse(protocol.stream_chunk(request_id, model, [], chat, usage_=usage))
    yield sse("[DONE]")
