"""The FastAPI app of `kiln serve`: OpenAI-compatible routes over one AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or SSE with `stream: true`),
GET /v1/models, GET /health, GET /metrics (Prometheus text).

Errors always use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for malformed
JSON, wrong types, unknown model, max_tokens <= 0 or past the context length; 401 for a missing or
wrong API key (when one is set); 503 when the bounded queue is full; 500 when the engine fails
while the request is in flight. A client that disconnects gets its sequences aborted (KV blocks freed).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.server import protocol
from kiln.server.async_engine import AsyncEngine, EngineError, QueueFull
from kiln.server.metrics import CONTENT_TYPE, ServerMetrics
from kiln.server.serving import APIError, OpenAIServing, bad_request, collect, stream_events

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def create_app(
    engine,
    model_name: str = DEFAULT_MODEL_NAME,
    api_key: str | None = None,
    max_queue: int | None = None,
) -> FastAPI:
    """Build the app around `engine` (an LLMEngine, or anything with its step API).

    max_queue: sequences allowed to wait beyond engine.config.max_num_seqs before 503 (None = 4x that).
    The engine loop thread starts with the app (lifespan) and stops with it.
    """
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, metrics, max_queue)
    serving = OpenAIServing(async_engine, model_name)
    counter = itertools.count()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="kiln serve", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    def error_response(exc: APIError) -> JSONResponse:
        metrics.requests_rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            loc = []  # its loc is a character position, not a parameter
            message = (
                f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            )
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(bad_request(message, ".".join(loc) or None, first.get("type")))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(APIError(500, f"internal error: {exc}", "server_error"))

    def check_auth(request: Request) -> None:
        """A route dependency: runs before the body is parsed, so a keyless bad request gets 401."""
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                None,
                "invalid_api_key",
            )

    async def run(
        request: Request,
        subs,
        chat: bool,
        top_n,
        prompt_tokens: int,
        stream: bool,
        include_usage,
        echo_texts=None,
    ):
        request_id = protocol.new_id("chatcmpl" if chat else "cmpl")
        try:
            queue = await async_engine.submit(subs)
        except QueueFull as exc:
            raise APIError(503, str(exc), "server_overloaded", None, "queue_full") from exc
        except EngineError as exc:
            raise APIError(500, str(exc), "server_error", None, "engine_error") from exc
        except ValueError as exc:  # the engine's own checks
            raise bad_request(str(exc)) from exc
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                async_engine.release(subs)

        if stream:

            async def events():
                try:
                    async for event in stream_events(
                        serving,
                        queue,
                        len(subs),
                        request_id,
                        chat,
                        top_n,
                        prompt_tokens,
                        include_usage,
                        echo_texts,
                    ):
                        yield event
                finally:
                    release()  # runs on disconnect too (the stream is cancelled)

            # the background task covers a stream cancelled before its first chunk
            return StreamingResponse(
                events(), media_type="text/event-stream", background=BackgroundTask(release)
            )
        try:
            finals = await _until_disconnect(request, collect(queue, len(subs)))
        except EngineError as exc:
            raise APIError(500, str(exc), "server_error", None, "engine_error") from exc
        finally:
            release()
        if finals is None:  # client gone: nobody to answer
            return Response(status_code=499)
        body = serving.final_response(request_id, finals, chat, top_n, prompt_tokens, echo_texts)
        return JSONResponse(body)

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(req: protocol.CompletionRequest, request: Request):
        prompts = serving.completion_prompts(req)
        subs = serving.build(
            req, prompts, _max_tokens(req.max_tokens, 16), req.logprobs, f"cmpl{next(counter)}"
        )
        echo_texts = None
        if req.echo:
            texts = [serving.tokenizer.decode(p) for p in prompts]
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

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(req: protocol.ChatCompletionRequest, request: Request):
        prompt = serving.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        subs = serving.build(req, [prompt], _max_tokens(max_tokens, None), top_n, f"chat{next(counter)}")
        return await run(
            request,
            subs,
            True,
            top_n,
            len(prompt),
            req.stream,
            bool(req.stream_options and req.stream_options.include_usage),
        )

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
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
