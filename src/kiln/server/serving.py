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

Streams ask the engine for delta outputs (SamplingParams.output_kind "delta": each output holds only
its new text, tokens and logprobs, text that may begin a stop string held back by the engine until it
is ruled out), so each event is what its output holds; non-streaming requests ask for "final_only".
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import json
import re
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from jinja2.exceptions import TemplateError

from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.engine.sampling_params import SamplingParams
from kiln.server import protocol
from kiln.server.async_engine import AsyncEngine, SubRequest
from kiln.server.tool_calls import ToolReplies
from kiln.server.tool_parsers import tool_parser
from kiln.server.tool_protocol import template_message, template_tools

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
        vocab = getattr(getattr(getattr(self.engine, "model", None), "config", None), "vocab_size", None)
        self.vocab_size: int | None = vocab
        self._tokens: dict[int, tuple[str, bytes]] = {}  # token id -> (logprobs text, bytes)
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
        """The prompts of a completion request: texts, or token-id lists (one list of ids is one
        prompt, a list of such lists a batch of them)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request(
                "prompt is empty; give a string, a list of strings, a list of token ids or a list of "
                "token-id lists",
                "prompt",
            )
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        for i, p in enumerate(prompt):
            if not p:
                raise bad_request(f"prompt[{i}] is empty", f"prompt[{i}]")
        return list(prompt)

    # ---- tokenization (on the tokenizer threads) ----
    async def completion_prompts(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        if prompts and not isinstance(prompts[0], str):
            return [list(p) for p in prompts]
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
        messages = [template_message(m) for m in req.messages]
        tools, kwargs = template_tools(req.tools), req.chat_template_kwargs
        return await self.off_loop(self._encode_chat, messages, tools, kwargs)

    def _encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
    ) -> list[int]:
        encode_chat = getattr(self.tokenizer, "encode_chat", None)
        # only what is given (stand-in tokenizers take neither)
        extra = {k: v for k, v in (("tools", tools), ("template_kwargs", template_kwargs)) if v}
        try:
            if encode_chat is not None:  # kiln's Tokenizer: content text is never a special token
                ids = encode_chat(
                    messages,
                    add_generation_prompt=True,
                    special_tokens_in_content=self.allow_special_tokens_in_chat,
                    **extra,
                )
            else:  # tokenizers without it: plain template + encode
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
                # the template writes its own special tokens; don't let encode add a second BOS
                ids = self.tokenizer.encode(text, add_special_tokens=False)
        except ValueError as exc:  # the template raises on conversations it does not accept
            raise bad_request(f"messages: {exc}", "messages") from exc
        except TemplateError as exc:  # the template's raise_exception, an undefined variable, ...
            raise bad_request(f"messages: the chat template rejected them: {exc}", "messages") from exc
        if sum(len(m["content"]) for m in messages) >= _LARGE_PROMPT_CHARS:
            release_freed_memory()
        return ids

    async def compile_constraint(self, req) -> None:
        """Compile the request's output constraint (response_format, structured_outputs, guided_*) on the
        tokenizer threads, so that the engine loop finds it in the compiler's cache; 400 naming the
        field when it cannot be compiled (or the model's tokenizer cannot take one)."""
        params = req.structured_params()
        compiler = getattr(self.engine, "structured_outputs", None)
        if params is None or compiler is None:
            return
        try:
            await self.off_loop(compiler.compile, params)
        except ValueError as exc:
            raise bad_request(str(exc), req.constraint_param(), "invalid_constraint") from exc

    # ---- request -> sub-requests ----
    def build(
        self,
        req,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        tag: str,
        prompt_logprobs: int | None = None,
    ):
        """Sub-requests for every prompt x choice; validates lengths and sampling fields (400 on error).
        A stream's get delta outputs, the others one final output. prompt_logprobs: top-n per prompt
        token too (completions' echo with logprobs)."""
        vocab = self.vocab_size
        stop_token_ids = req.stop_token_ids
        logit_bias = req.token_biases()
        token_id_fields = (
            ("stop_token_ids", stop_token_ids),
            ("logit_bias", logit_bias),
            ("allowed_token_ids", req.allowed_token_ids),
        )
        for name, ids in token_id_fields:
            outside = [t for t in (ids or ()) if vocab is not None and t >= vocab]
            if outside:
                raise bad_request(
                    f"{name}: {outside[0]} is not a token id of this model (ids are 0..{vocab - 1})", name
                )
        output_kind = "delta" if req.stream else "final_only"
        structured = req.structured_params()
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
            if vocab is not None and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):
                raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
            if (req.min_tokens or 0) > tokens:
                raise bad_request(
                    f"min_tokens: {req.min_tokens} is more than max_tokens ({tokens})", "min_tokens"
                )
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
                        stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
                        ignore_eos=req.ignore_eos,
                        include_stop_str_in_output=req.include_stop_str_in_output,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                        output_kind=output_kind,
                        presence_penalty=req.presence_penalty or 0.0,
                        frequency_penalty=req.frequency_penalty or 0.0,
                        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                        logit_bias=logit_bias,
                        min_tokens=req.min_tokens or 0,
                        allowed_token_ids=req.allowed_token_ids,
                        bad_words=req.bad_words or None,
                        structured_outputs=structured,
                    )
                except ValueError as exc:  # protocol.py checked the fields first: a backstop
                    raise bad_request(str(exc), None, "invalid_value") from exc
                subs.append(SubRequest(f"{tag}-{p}-{i}", prompt_ids, params, index=p * req.n + i))
        return subs

    # ---- outputs -> responses ----
    def logprob_entries(self, out, top_n: int) -> list[protocol.LogprobEntry]:
        """The logprobs of the output tokens `out` holds (all of them, or a delta output's new ones)."""
        return [] if out.logprobs is None else self._entries(out.token_ids, out.logprobs, top_n)

    def prompt_logprob_entries(self, out, top_n: int) -> list[protocol.LogprobEntry]:
        """The echoed prompt's logprobs, as vLLM gives them: the first token has none (no context), each
        other its logprob given the tokens before it and the top_n alternatives."""
        return self._entries(out.prompt_token_ids, out.prompt_logprobs or (), top_n)

    def _entries(self, token_ids, tables, top_n: int) -> list[protocol.LogprobEntry]:
        """One entry per (token, {token id: logprob}) pair; a None table (a prompt's first token) gives
        an entry with no logprob and no alternatives."""
        entries = []
        for token_id, table in zip(token_ids, tables, strict=False):
            token, raw = self.token(token_id)
            if table is None:
                entries.append(protocol.LogprobEntry(token, raw, None, None))
                continue
            top = sorted(table.items(), key=lambda kv: -kv[1])[:top_n]
            alternatives = [(*self.token(t), float(v)) for t, v in top]
            logprob = float(table.get(token_id, float("-inf")))
            entries.append(protocol.LogprobEntry(token, raw, logprob, alternatives))
        return entries

    def echoed_logprobs(self, out, top_n: int, output_offsets: TextOffsets) -> dict:
        """Completions' logprobs of an echoed choice's first output: the prompt's tokens (offsets from 0
        in the prompt's decoded text), then the output's (offsets after the echoed text)."""
        entries = self.prompt_logprob_entries(out, top_n) + self.logprob_entries(out, top_n)
        offsets = TextOffsets(self.tokenizer, [], 0).next(out.prompt_token_ids)
        offsets += output_offsets.next(out.token_ids)
        return protocol.completion_logprobs(entries, offsets)

    def text_offsets(self, prompt_ids: list[int], start: int) -> TextOffsets:
        return TextOffsets(self.tokenizer, prompt_ids, start)

    def final_response(
        self,
        request_id: str,
        created: int,
        finals: list,
        chat: bool,
        top_n: int | None,
        prompt_tokens: int,
        echo_texts: list[str] | None = None,
        tools: ToolReplies | None = None,
    ) -> dict:
        """The non-streaming response body from each choice's final RequestOutput (a chat reply's tool
        calls read by `tools`)."""
        choices = []
        for index, out in enumerate(finals):
            entries = self.logprob_entries(out, top_n) if top_n is not None else None
            if chat:
                logprobs = protocol.chat_logprobs(entries) if entries is not None else None
                message, finish_reason = (tools or NO_TOOLS).message(out.text, out.finish_reason)
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                    }
                )
            else:
                echo = echo_texts[index] if echo_texts else ""
                logprobs = None
                if entries is not None and echo_texts:
                    offsets = self.text_offsets(out.prompt_token_ids, len(echo))
                    logprobs = self.echoed_logprobs(out, top_n, offsets)
                elif entries is not None:
                    offsets = self.text_offsets(out.prompt_token_ids, len(echo)).next(out.token_ids)
                    logprobs = protocol.completion_logprobs(entries, offsets)
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
        return protocol.completion_response(request_id, self.model_name, choices, usage, chat, created)

    def token(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token as logprobs show it (cached: the vocabulary is fixed)."""
        known = self._tokens.get(token_id)
        if known is None:
            known = self._tokens[token_id] = token_text_and_bytes(self.tokenizer, token_id)
        return known


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE piece uses -> the byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_text_and_bytes(tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's text as logprobs show it, and its bytes. Most tokens: their decoded text and its UTF-8.
    A token that is part of a UTF-8 character (byte-level BPE pieces, SentencePiece <0xNN> pieces)
    decodes alone to U+FFFD, which names no byte and makes every such token the same text: its bytes
    come from its vocabulary piece instead, and its text is them in OpenAI's form, "bytes:" then the
    text with each byte that is not a whole character as \\xNN ("bytes:\\xe7" for 0xE7)."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text, text.encode("utf-8")
    raw = _piece_bytes(tokenizer, token_id)
    if raw is None or raw.decode("utf-8", errors="replace") != text:
        return text, text.encode("utf-8")  # no piece, or one read otherwise: keep the decoded text
    try:
        return raw.decode("utf-8"), raw  # a token whose text is U+FFFD itself
    except UnicodeDecodeError:
        return "bytes:" + raw.decode("utf-8", errors="backslashreplace"), raw


def _piece_bytes(tokenizer, token_id: int) -> bytes | None:
    id_to_token = getattr(tokenizer, "id_to_token", None)
    piece = id_to_token(token_id) if id_to_token is not None else None
    if not piece:
        return None
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match[1], 16)])
    decoder = _byte_level_decoder()
    if all(c in decoder for c in piece):
        return bytes(decoder[c] for c in piece)
    return None


class TextOffsets:
    """The completions API's text_offset of each output token: where its text starts in the choice's
    text (`start`: the echoed prompt's length). The tokens are detokenized again as the engine does
    (with the prompt's last tokens in front), so a token that only starts a character points at that
    character, and the offsets of a stream, fed in pieces, are those of the whole."""

    def __init__(self, tokenizer, prompt_ids: list[int], start: int):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.start = start

    def next(self, token_ids: list[int]) -> list[int]:
        offsets = []
        for token_id in token_ids:
            offsets.append(self.start + len(self.detokenizer.text))
            self.detokenizer.add_tokens([token_id])
        return offsets


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


NO_TOOLS = ToolReplies("none")  # a chat request without tools: its reply is content


def _merged(first: dict, second: dict) -> dict:
    """Two stream deltas of one event as one (content texts joined)."""
    if "content" in first and "content" in second:
        return {**first, **second, "content": first["content"] + second["content"]}
    return {**first, **second}


def tool_replies(req: protocol.ChatCompletionRequest, parser_name: str | None) -> ToolReplies:
    """How the request's replies become messages; `parser_name`: the server's tool-call parser."""
    mode = req.tool_mode()
    if mode == "auto":
        if parser_name is None:
            raise bad_request(
                'tool_choice: "auto" (the default when tools are given) needs a server started with '
                '--enable-auto-tool-choice --tool-call-parser NAME; send tool_choice "required", a '
                'named function or "none" to this one',
                "tool_choice",
            )
        return ToolReplies(mode, tool_parser(parser_name))
    function = req.tool_choice.function.name if mode == "named" else None
    return ToolReplies(mode, function=function)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def stream_events(
    serving: OpenAIServing,
    queue: asyncio.Queue,
    count: int,
    request_id: str,
    created: int,
    chat: bool,
    top_n: int | None,
    prompt_tokens: int,
    include_usage: bool,
    echo_texts: list[str] | None = None,
    tools: ToolReplies | None = None,
) -> AsyncIterator[str]:
    """The SSE stream: text deltas per choice as tokens arrive, a finish chunk per choice, optional
    usage chunk, then `data: [DONE]`. An engine failure becomes an error event before [DONE].
    The queue carries the engine's delta outputs: each event sends what its output holds (the engine
    holds back text that may begin a stop string, so the streamed text is the non-streamed one). A chat
    choice's text goes through its ToolStream (`tools`): content, or tool-call deltas."""
    model = serving.model_name
    tool_streams = [(tools or NO_TOOLS).stream() for _ in range(count)] if chat else None
    # completions' text_offset: counted from the echoed prompt, as the non-streamed response counts
    offsets: list[TextOffsets | None] = [None] * count
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
        yield sse(protocol.stream_chunk(request_id, model, first, True, created))
    elif echo_texts and top_n is None:
        echoed = [
            {"index": i, "text": echo_texts[i], "logprobs": None, "finish_reason": None} for i in range(count)
        ]
        yield sse(protocol.stream_chunk(request_id, model, echoed, False, created))
    # echo with logprobs: each choice's prompt and its logprobs go out with its first output
    echo_pending = [bool(echo_texts) and top_n is not None and not chat] * count
    remaining = count
    while remaining:
        index, item = await queue.get()
        if isinstance(item, Exception):
            yield sse(protocol.error_body(str(item), "server_error", None, "engine_error"))
            break
        completion_tokens += len(item.token_ids)
        delta = item.text
        logprobs = None
        if top_n is not None and item.token_ids:
            entries = serving.logprob_entries(item, top_n)
            if chat:
                logprobs = protocol.chat_logprobs(entries)
            else:
                if offsets[index] is None:
                    start = len(echo_texts[index]) if echo_texts else 0
                    offsets[index] = serving.text_offsets(item.prompt_token_ids, start)
                if echo_pending[index]:
                    logprobs = serving.echoed_logprobs(item, top_n, offsets[index])
                else:
                    logprobs = protocol.completion_logprobs(entries, offsets[index].next(item.token_ids))
        if echo_pending[index]:
            echo_pending[index] = False
            delta = echo_texts[index] + delta
        finish = item.finish_reason if item.finished else None
        if item.finished:
            remaining -= 1
        if not (delta or finish or logprobs):
            continue
        if chat:
            message = tool_streams[index].feed(delta)
            if item.finished:
                last, finish = tool_streams[index].finish(finish)
                message = _merged(message, last)
            if not (message or finish or logprobs):
                continue
            choice = {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
        yield sse(protocol.stream_chunk(request_id, model, [choice], chat, created))
    else:
        if include_usage:
            usage = protocol.usage(prompt_tokens, completion_tokens)
            yield sse(protocol.stream_chunk(request_id, model, [], chat, created, usage_=usage))
    yield sse("[DONE]")
