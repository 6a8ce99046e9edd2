"""The FastAPI app of `kiln serve`: OpenAI-compatible routes over one AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or SSE with `stream: true`),
GET /v1/models, GET /health, GET /metrics (Prometheus text).

Errors always use OpenAI's body {"error": {"message", "type", "param", "code"}} (docs/server.md lists
them): 400 for malformed JSON, wrong types (strict: `true` is not an integer), values out of range,
unknown model, a request that could never fit the server, max_tokens past the context length; 401 for a
missing or wrong API key (when one is set); 413 for a body over max_body_bytes (checked before it is
read); 503 when the bounded queue is full, or when the engine loop has stopped (it died: nothing can
be served); 500 when the engine fails while the request is in flight, or on a bug (the message then
says only that; the details go to the log). A client that disconnects gets its sequences aborted (KV
blocks freed).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import itertools
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.server import protocol
from kiln.server.async_engine import AsyncEngine, EngineError, EngineStopped, QueueFull
from kiln.server.metrics import CONTENT_TYPE, ServerMetrics
from kiln.server.serving import APIError, OpenAIServing, bad_request, collect, stream_events, tool_replies
from kiln.server.tool_parsers import tool_parser

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: ~1M tokens of text, far past any context length served here

log = logging.getLogger("kiln.server")


def create_app(
    engine,
    model_name: str = DEFAULT_MODEL_NAME,
    api_key: str | None = None,
    max_queue: int | None = None,
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
    allow_special_tokens_in_chat: bool = False,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """Build the app around `engine` (an LLMEngine, or anything with its step API that honours
    SamplingParams.output_kind: streams ask for "delta" outputs, other requests "final_only").

    max_queue: sequences allowed to wait beyond engine.config.max_num_seqs before 503 (None = 4x that).
    max_body_bytes: larger request bodies get 413 before they are read (None = no limit).
    allow_special_tokens_in_chat: let special-token text in chat message content (`<|im_start|>`)
        become control tokens; by default it is tokenized as the text it is.
    tool_call_parser: the parser (kiln.server.tool_parsers: "hermes", "llama3_json", "pythonic") that
        reads the calls of a chat request with tools and tool_choice "auto" (without one such requests
        get a 400; named and required tool choices need none).
    The engine loop thread starts with the app (lifespan) and stops with it.
    """
    metrics = ServerMetrics()
    runner = getattr(engine, "runner", None)
    if runner is not None:  # an LLMEngine: its KV cache is known (and its block count) before any step
        exact = getattr(runner, "exact_kv", None)
        metrics.set_kv_cache(
            str(runner.kv_cache_dtype).removeprefix("torch."),
            runner.block_size,
            exact.num_blocks if exact is not None else 0,
            exact.window if exact is not None else -1,
        )
        metrics.set_engine_stats(engine.stats())
    async_engine = AsyncEngine(engine, metrics, max_queue)
    serving = OpenAIServing(async_engine, model_name, allow_special_tokens_in_chat)
    if tool_call_parser is not None:
        tool_parser(tool_call_parser)  # an unknown name: ValueError now, not at the first request
    counter = itertools.count()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        serving.start()
        try:
            yield
        finally:
            async_engine.stop()
            serving.stop()

    app = FastAPI(title="kiln serve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    def error_response(exc: APIError) -> JSONResponse:
        metrics.requests_rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    # the last added runs first: the body-size limit, then the key (before FastAPI parses the body, so a
    # keyless malformed request is a 401, not a 400)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key, reject=error_response)
    if max_body_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, reject=error_response)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        # a union field reports one error per member: prefer a value error over "not that type"
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0] if errors else {})
        if first.get("type") == "json_invalid":  # its loc is a character position, not a parameter
            error = first.get("ctx", {}).get("error", first.get("msg"))
            return error_response(
                bad_request(f"the request body is not valid JSON: {error}", None, "json_invalid")
            )
        # a check of the whole request that names the field it refuses puts it in ctx["param"]
        param = first.get("ctx", {}).get("param") or _param_name(first.get("loc", ()))
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        return error_response(bad_request(f"{param or 'body'}: {message}", param, first.get("type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(APIError(exc.status_code, str(exc.detail), kind, None, code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # outside the routes (their own guard)
        log.error("kiln serve: unexpected error on %s", request.url.path, exc_info=exc)
        return error_response(_internal_error())

    async def run(
        request: Request,
        subs,
        chat: bool,
        top_n,
        prompt_tokens: int,
        stream: bool,
        include_usage,
        echo_texts=None,
        tools=None,
    ):
        request_id = protocol.new_id("chatcmpl" if chat else "cmpl")
        created = int(time.time())  # one value for the response, or for every chunk of the stream
        try:
            queue = await async_engine.submit(subs)
        except QueueFull as exc:
            raise APIError(503, str(exc), "server_overloaded", None, "queue_full") from exc
        except EngineStopped as exc:
            raise APIError(503, str(exc), "server_error", None, "engine_stopped") from exc
        except EngineError as exc:
            raise APIError(500, str(exc), "server_error", None, "engine_error") from exc
        except ValueError as exc:  # the engine's own checks
            raise bad_request(str(exc), None, "invalid_value") from exc
        released = False

        def release(client_gone: bool = True):
            nonlocal released
            if not released:
                released = True
                async_engine.release(subs, client_gone)

        if stream:

            async def events():
                client_gone = True  # until the events run out: a disconnect cancels the loop below
                try:
                    async for event in stream_events(
                        serving,
                        queue,
                        len(subs),
                        request_id,
                        created,
                        chat,
                        top_n,
                        prompt_tokens,
                        include_usage,
                        echo_texts,
                        tools,
                    ):
                        yield event
                    client_gone = False
                finally:
                    release(client_gone)  # runs on disconnect too (the stream is cancelled)

            # the background task covers a stream cancelled before its first chunk
            return StreamingResponse(
                events(), media_type="text/event-stream", background=BackgroundTask(release)
            )
        finals = failure = None
        try:
            finals = await _until_disconnect(request, collect(queue, len(subs)))
        except EngineError as exc:
            failure = exc
            raise APIError(500, str(exc), "server_error", None, "engine_error") from exc
        finally:
            release(client_gone=finals is None and failure is None)
        if finals is None:  # client gone: nobody to answer
            return Response(status_code=499)
        body = await serving.off_loop(
            serving.final_response, request_id, created, finals, chat, top_n, prompt_tokens, echo_texts, tools
        )
        return JSONResponse(body)

    @app.post("/v1/completions")
    @_guarded
    async def completions(req: protocol.CompletionRequest, request: Request):
        # the cheap checks first: nothing is tokenized for a request refused anyway
        serving.check_model(req.model)
        max_tokens = _max_tokens(req.max_tokens, 16)
        texts = serving.prompt_texts(req)
        serving.check_fits(len(texts), req.n)
        await serving.compile_constraint(req)
        prompts = await serving.completion_prompts(texts)
        # echo with logprobs: the prompt's logprobs too (vLLM's answer; lm-eval scores prompts so)
        prompt_logprobs = req.logprobs if req.echo else None
        subs = serving.build(req, prompts, max_tokens, req.logprobs, f"cmpl{next(counter)}", prompt_logprobs)
        echo_texts = None
        if req.echo:  # the prompt as sent: its text, or for token ids their decoded text
            if not isinstance(texts[0], str):
                texts = await serving.off_loop(lambda: [serving.tokenizer.decode(p) for p in prompts])
            echo_texts = [texts[i // req.n] for i in range(len(subs))]
        return await run(
            request,
            subs,
            False,
            req.logprobs,
            sum(map(len, prompts)),
            req.stream,
            bool(req.stream_options and req.stream_options.include_usage),
            echo_texts,
        )

    @app.post("/v1/chat/completions")
    @_guarded
    async def chat_completions(req: protocol.ChatCompletionRequest, request: Request):
        serving.check_model(req.model)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = _max_tokens(max_tokens, None)
        serving.check_fits(1, req.n)
        tools = tool_replies(req, tool_call_parser)
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        await serving.compile_constraint(req)
        prompt = await serving.chat_prompt(req)
        subs = serving.build(req, [prompt], max_tokens, top_n, f"chat{next(counter)}")
        return await run(
            request,
            subs,
            True,
            top_n,
            len(prompt),
            req.stream,
            bool(req.stream_options and req.stream_options.include_usage),
            tools=tools,
        )

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kiln",
            "max_model_len": serving.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not async_engine.is_alive:
            return JSONResponse({"status": "engine loop not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _guarded(route):
    """A route whose unexpected exceptions become a logged 500 with a generic message: the exception
    text stays in the log, and (unlike Starlette's catch-all, which re-raises) the connection stays
    open for the client's next request."""

    @functools.wraps(route)
    async def guarded(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except (APIError, StarletteHTTPException, RequestValidationError):
            raise
        except Exception as exc:
            log.error("kiln serve: unexpected error in %s", route.__name__, exc_info=exc)
            raise _internal_error() from exc

    return guarded


def _internal_error() -> APIError:
    return APIError(
        500, "internal server error (the server log has the details)", "server_error", None, "internal_error"
    )


def _param_name(loc) -> str | None:
    """A pydantic error location as the request parameter it names ("messages[0].content"): the field
    names and list indices, without "body" and union-member tags such as "list[int]"."""
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in protocol.FIELD_NAMES:
            name += f".{part}" if name else part
    return name or None


class ApiKeyCheck:
    """ASGI middleware: every path but /health and /metrics needs `Authorization: Bearer <api_key>`
    (else 401), checked before the route reads or parses the body. The path is taken relative to the
    app's root_path (a proxy prefix or a mount point), which Starlette's scope["path"] includes."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, api_key: str, reject):
        self.app, self.api_key, self.reject = app, api_key.encode(), reject

    async def __call__(self, scope, receive, send):
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if scope["type"] == "http" and path not in self.OPEN:
            header = dict(scope.get("headers", ())).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                error = APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
                return await self.reject(error)(scope, receive, send)
        await self.app(scope, receive, send)


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over max_bytes. A declared Content-Length over the limit
    is refused before anything is read; a chunked body is counted as it arrives and refused once over
    (FastAPI re-raises the HTTPException from its body reader, so the app's handler answers)."""

    def __init__(self, app, max_bytes: int, reject):
        self.app, self.max_bytes, self.reject = app, max_bytes, reject

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes} bytes "
            "(kiln serve --max-body-bytes)",
            "invalid_request_error",
            None,
            "request_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self.reject(self._too_large())(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, self._too_large().message)
            return message

        await self.app(scope, counted_receive, send)


def _max_tokens(value: int | None, default: int | None) -> int | None:
    if value is None:
        return default
    if value < 1:
        raise bad_request(f"max_tokens={value}: expected an integer >= 1", "max_tokens", "invalid_value")
    return value


async def _until_disconnect(request: Request, work):
    """Await `work`; if the client disconnects first, cancel it and return None."""
    work_task = asyncio.ensure_future(work)

    async def disconnected():
        while True:  # the body was read already: the next message is the disconnect
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch_task = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work_task.cancel()
        raise
    finally:
        watch_task.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    return None
