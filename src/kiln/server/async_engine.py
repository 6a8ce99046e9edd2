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

Failures: if `engine.step()` raises a SamplingError, which names the requests it failed for and has
advanced nothing, only those requests get an EngineError (and are aborted in the engine); the next step
runs the others as if they had never been batched with them. Any other exception from the step fails
every sequence the engine holds (the app answers 500 or an error event), the engine is told to abort
them, and the loop carries on with the next requests.
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

    # ---- lifecycle (event loop side) ----
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
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
        rejects one (none stay added)."""
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
            self._routes[sub.request_id] = _Route(queue, sub.index)
            future = loop.create_future()
            futures.append(future)
            self._commands.append(("add", sub, future))
        self._wakeup.set()
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException:  # cancelled (client gone): don't leak the admitted sequences
            self.release(subs)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.release(subs, client_gone=False)
            raise errors[0]
        return queue

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
        self._fail_all(EngineError("the server is shutting down"), include_pending=True)

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
            n = len(out.token_ids)
            if n > route.tokens_seen:
                if route.tokens_seen == 0:
                    if out.first_token_time is not None:
                        metrics.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
                else:
                    gap = (now - route.last_token_time) / (n - route.tokens_seen)
                    metrics.inter_token_latency.observe(gap)
                route.tokens_seen, route.last_token_time = n, now
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
