"""AsyncEngine: the server's one engine loop, a worker thread that owns the LLMEngine.

The engine is not thread-safe and its steps are long, blocking CPU/GPU work, so exactly one thread
touches it. The asyncio side hands it commands (add / abort) through a deque; the thread applies them
between steps (so a request arriving mid-generation joins the running batch at the next step), calls
`engine.step()` while work exists, and pushes each RequestOutput onto the asyncio.Queue of the HTTP
request that owns it (`loop.call_soon_threadsafe`). Queue items are `(choice_index, RequestOutput)`
or `(choice_index, EngineError)`.

Admission: at most `capacity` sequences (max_num_seqs running + max_queue waiting) may be in flight;
`submit` raises QueueFull past that, so the waiting queue is bounded (the app answers 503), and
ValueError for a request of more sequences than the capacity itself (it could never run: 400).

Outputs: a sub-request's SamplingParams.output_kind says what its outputs hold: streams use "delta"
(each output only what is new), non-streaming requests "final_only" (one output, at the end: one
queue put a choice). Latency metrics count the tokens either way.

Failures: if `engine.step()` raises a SamplingError, which names the requests it failed for and has
advanced nothing, only those requests get an EngineError (and are aborted in the engine); the next step
runs the others as if they had never been batched with them. Any other exception from the step fails
every sequence the engine holds (the app answers 500 or an error event), the engine is told to abort
them, and the loop carries on with the next requests. If the loop itself dies (an exception its
guard does not catch), every request in flight or waiting to be added gets an EngineError, and
`submit` refuses new ones at once with EngineStopped (the app answers 503) instead of queueing work
no thread will ever run.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass

from kiln.engine.sampler import SamplingError
from kiln.engine.sampling_params import SamplingParams
from kiln.server.metrics import ServerMetrics

log = logging.getLogger("kiln.server")


class QueueFull(Exception):
    """More sequences than the server admits (running + bounded waiting queue)."""


class EngineError(Exception):
    """The engine failed while this request was in flight."""


class EngineStopped(Exception):
    """The engine loop thread is not running (it died, or the server is stopping): nothing can be served."""


@dataclass
class SubRequest:
    """One engine request: a prompt (token ids) sampled once. An HTTP request with n choices or several
    prompts becomes several SubRequests sharing one output queue; `index` is the choice index."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    index: int = 0


@dataclass
class _Route:
    queue: asyncio.Queue
    index: int
    output_kind: str = "cumulative"  # its SamplingParams.output_kind
    added: bool = False  # the engine has it (its add command was applied)
    tokens_seen: int = 0
    last_token_time: float = 0.0


class AsyncEngine:
    """Drives `engine` (the kiln.engine LLMEngine step API) from one background thread."""

    def __init__(self, engine, metrics: ServerMetrics | None = None, max_queue: int | None = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        max_num_seqs = getattr(getattr(engine, "config", None), "max_num_seqs", 64)
        self.capacity = max_num_seqs + (max_queue if max_queue is not None else 4 * max_num_seqs)
        self.in_flight = 0  # sequences admitted and not released; touched only on the event loop
        self.metrics.capacity.set(self.capacity)
        self._commands: collections.deque = collections.deque()
        self._wakeup = threading.Event()
        self._routes: dict[str, _Route] = {}  # written by both sides; single dict ops are atomic
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._death: BaseException | None = None  # what ended the loop thread, if not stop()

    # ---- lifecycle (event loop side) ----
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._death = None
        self._thread = threading.Thread(target=self._run, name="kiln-engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests (event loop side) ----
    async def submit(self, subs: list[SubRequest]) -> asyncio.Queue:
        """Add the sub-requests to the engine; returns the queue their outputs arrive on.
        Raises QueueFull when over capacity, ValueError when the request could never fit or the engine
        rejects one (none stay added), EngineStopped when the engine loop is not running."""
        self._check_alive()
        if len(subs) > self.capacity:
            raise ValueError(
                f"the request asks for {len(subs)} sequences (prompts x n); this server runs at most "
                f"{self.capacity} at once (running + queued): send fewer prompts or a smaller n"
            )
        if self.in_flight + len(subs) > self.capacity:
            raise QueueFull(
                f"the server is at capacity ({self.in_flight} sequences in flight, limit {self.capacity}); "
                "retry later"
            )
        self.in_flight += len(subs)
        self.metrics.in_flight.set(self.in_flight)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        futures = []
        for sub in subs:
            self._routes[sub.request_id] = _Route(queue, sub.index, sub.params.output_kind)
            future = loop.create_future()
            futures.append(future)
            self._commands.append(("add", sub, future))
        self._wakeup.set()
        try:
            results = await self._added(futures)
        except EngineStopped:  # the loop died meanwhile: not a client abort
            self.release(subs, client_gone=False)
            raise
        except BaseException:  # cancelled (client gone): don't leak the admitted sequences
            self.release(subs)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.release(subs, client_gone=False)
            raise errors[0]
        return queue

    def _check_alive(self) -> None:
        if not self.is_alive:
            why = "the server is not running" if self._death is None else f"it died: {self._death!r}"
            raise EngineStopped(f"the engine loop stopped ({why}); no request can be served")

    async def _added(self, futures: list) -> list:
        """The add commands' results (None or the exception), checking that the loop still runs: a
        thread that died just after the check in submit never applies them."""
        gathered = asyncio.gather(*futures, return_exceptions=True)
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(gathered), timeout=1.0)
            except asyncio.TimeoutError:
                if not self.is_alive:
                    gathered.cancel()
                    self._check_alive()
            except BaseException:
                gathered.cancel()
                raise

    def release(self, subs: list[SubRequest], client_gone: bool = True) -> None:
        """The HTTP request is done (answered, failed or disconnected): abort whatever still runs.
        client_gone: the client went away (counted in kiln_requests_aborted); False when the request
        failed (a sibling's engine error, a refused add), whose unfinished sequences are not aborts."""
        for sub in subs:
            if self._routes.pop(sub.request_id, None) is not None:
                self._commands.append(("abort", sub.request_id, None))
                if client_gone:
                    self.metrics.requests_aborted.inc()
        self.in_flight -= len(subs)
        self.metrics.in_flight.set(self.in_flight)
        self._wakeup.set()

    # ---- the engine thread ----
    def _run(self) -> None:
        reason = EngineError("the server is shutting down")
        try:
            self._serve()
        except BaseException as exc:  # past the loop's guard: nothing will serve the requests in flight
            log.critical("kiln serve: the engine loop died; every request now fails", exc_info=exc)
            self._death = exc
            reason = EngineError(f"the engine loop died: {exc!r}")
        finally:
            self._fail_all(reason, include_pending=True)

    def _serve(self) -> None:
        while not self._stopping:
            self._wakeup.clear()  # before draining: a command queued after this sets it again
            try:
                self._apply_commands()
                if not self.engine.has_unfinished_requests():
                    self.metrics.set_engine_stats(self.engine.stats())
                    self._wakeup.wait(timeout=1.0)
                    continue
                outputs = self.engine.step()
                self._dispatch(outputs)
                self.metrics.set_engine_stats(self.engine.stats())
            except SamplingError as exc:  # those requests only: the step redoes the others
                log.error("kiln serve: failing requests the sampler could not serve: %s", exc)
                self.metrics.engine_errors.inc()
                self._fail_requests(exc.failures)
            except Exception as exc:  # the loop must outlive any engine failure
                log.exception("kiln serve: engine step failed; failing the requests in flight")
                self.metrics.engine_errors.inc()
                self._fail_all(exc)

    def _apply_commands(self) -> None:
        while self._commands:
            kind, payload, future = self._commands.popleft()
            if kind == "abort":
                try:
                    self.engine.abort_request(payload)
                except Exception:
                    log.exception("kiln serve: abort of %s failed", payload)
                continue
            sub: SubRequest = payload
            try:
                if sub.request_id not in self._routes:  # released before it got here
                    raise EngineError("request cancelled before it started")
                self.engine.add_request(sub.request_id, sub.prompt_ids, sub.params)
                route = self._routes.get(sub.request_id)
                if route is not None:
                    route.added, route.last_token_time = True, time.perf_counter()
            except Exception as exc:
                self._call(future.set_exception, exc, future)
            else:
                self._call(future.set_result, None, future)

    def _dispatch(self, outputs) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # aborted: its client is gone
            # delta and final_only outputs hold only the tokens new since the last output
            new = len(out.token_ids) - (route.tokens_seen if route.output_kind == "cumulative" else 0)
            if new > 0:
                if route.tokens_seen == 0 and out.first_token_time is not None:
                    metrics.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
                if route.output_kind == "final_only":
                    _observe_final_gaps(metrics.inter_token_latency, out, new)
                elif route.tokens_seen:
                    metrics.inter_token_latency.observe((now - route.last_token_time) / new)
                route.tokens_seen, route.last_token_time = route.tokens_seen + new, now
            if out.finished:
                self._routes.pop(out.request_id, None)
                metrics.requests_finished.labels(out.finish_reason or "unknown").inc()
                if out.finished_time is not None:
                    metrics.e2e_latency.observe(max(0.0, out.finished_time - out.arrival_time))
            self._call(route.queue.put_nowait, (route.index, out))

    def _fail_requests(self, failures: dict[str, str]) -> None:
        """Answer just these requests with an EngineError and abort them in the engine."""
        for request_id, why in failures.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("kiln serve: abort of %s failed", request_id)
            route = self._routes.pop(request_id, None)
            if route is not None:
                self._call(route.queue.put_nowait, (route.index, EngineError(f"request failed: {why}")))

    def _fail_all(self, exc: Exception, include_pending: bool = False) -> None:
        """Answer every request the engine holds with an EngineError and abort it there. Requests whose
        add command is still queued (they arrived during the failed step) are kept, unless shutting down."""
        error = EngineError(f"engine failure: {exc}")
        for request_id, route in list(self._routes.items()):
            if not (route.added or include_pending):
                continue
            self._routes.pop(request_id, None)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("kiln serve: abort of %s failed", request_id)
            self._call(route.queue.put_nowait, (route.index, error))
        if include_pending:
            while self._commands:
                kind, _, future = self._commands.popleft()
                if kind == "add":
                    self._call(future.set_exception, error, future)

    def _call(self, fn, arg, future=None) -> None:
        """Run fn(arg) on the event loop (skipped if the future was cancelled or the loop is gone)."""

        def apply():
            if future is None or not future.done():
                fn(arg)

        try:
            self._loop.call_soon_threadsafe(apply)
        except RuntimeError:
            pass  # event loop closed: the server is shutting down


def _observe_final_gaps(histogram, out, tokens: int) -> None:
    """A final_only output's inter-token latency: its tokens' mean gap (first token to finish), once
    per gap (a stream observes one gap an output, mostly one a token). The output has no step times."""
    if tokens < 2 or out.first_token_time is None or out.finished_time is None:
        return
    gap = max(0.0, out.finished_time - out.first_token_time) / (tokens - 1)
    for _ in range(tokens - 1):
        histogram.observe(gap)
