"""TensorParallelEngine: the LLMEngine of rank 0 with the model split over `tp_size` processes.

Rank 0 (this process) owns the scheduler, block manager, sampler and tokenizer. Every rank loads its
shard with the same kiln.loaders.load_model call (the EngineConfig's dtype and CPU weight formats,
`tp_group` = the group); rank 0's LLMEngine is an ordinary one over its shard whose model runner
broadcasts each step's inputs (StepBroadcaster, the runner's before_forward hook) to the workers, and
all ranks run their shard of the forward pass together (all-reduces inside the model, logits gathered
to rank 0, which samples). Workers are spawned on this machine (torch.multiprocessing), or already running
under torchrun (env RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; this process must be RANK 0).

Pipeline parallelism (pp_size > 1, docs/pipeline_parallel.md): tp_size x pp_size ranks, rank =
stage * tp_size + tp_rank; every rank builds only its stage's layers (load_stage) and runs each
broadcast step through a PipelineStageRunner (micro-batches flowing through the stages, hidden states
sent point to point, logits back to rank 0, which samples).

Failure: before each step the spawned workers' liveness is checked; a collective that a dead or hung
worker never joins fails after `timeout_s`. Either way the step raises TensorParallelError naming the
rank, and the engine shuts down (workers joined, then killed; no orphans). A spawned worker that dies
during start-up (before joining the group, or while loading its shard) fails the construction at once
with TensorParallelError naming it. Any other exception on rank 0 mid-step (KeyboardInterrupt,
MemoryError) leaves the ranks out of step: the engine shuts down at once and re-raises it. `shutdown()`
(also run at interpreter exit) stops the workers and leaves the process group.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import multiprocessing.connection
import os
import queue
import sys
import threading
import time

import torch

from kiln.distributed.collectives import all_gather_object, broadcast_object
from kiln.distributed.groups import (
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    TensorParallelError,
    agree_on_device_type,
    check_ep_size,
    check_local_devices,
    destroy_tp_group,
    free_port,
    launched_by_torchrun,
    pipeline_layout,
    rank_layout,
    torchrun_store,
)
from kiln.distributed.pipeline_lanes import LaneScheduler, lane_count, lane_max_num_seqs
from kiln.distributed.stage_runner import PipelineStageRunner
from kiln.distributed.worker import agree_on_blocks, join_groups, load_shard, load_stage, spawn_main
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.model_runner import ModelInputs, ModelRunner
from kiln.engine.outputs import RequestOutput
from kiln.engine.sampler import SamplingError
from kiln.loaders import LoadedModel, open_checkpoint
from kiln.models.layers.tp import TPGroup
from kiln.models.sharding import (
    ShardPlan,
    check_expert_parallel,
    check_pipeline_parallel,
    intermediate_unit,
    routed_experts,
    with_intermediate_unit,
)


class StepBroadcaster:
    """Rank 0's ModelRunner hook (before_forward): sends each step's inputs, on the CPU, to the other
    ranks, which run the same step on them (worker.serve_steps); `send` sends rank 0's other messages
    (stats, stop) in the same order.

    background: broadcast from a thread, in order, so that rank 0 goes on with the step. A gloo
    broadcast returns on the root only when every rank has joined it, and the last pipeline stage
    joins step t + 1 only after finishing step t: with several steps in flight (pipeline lanes),
    waiting for it would stall the first stage. An error of the thread's broadcast is raised by the
    next send or flush."""

    def __init__(self, group: TPGroup, background: bool = False):
        self.group = group
        self._queue: queue.Queue | None = None
        self._error: BaseException | None = None
        if background:
            self._queue = queue.Queue()
            threading.Thread(target=self._send_in_order, daemon=True, name="kiln-step-broadcast").start()

    def __call__(self, inputs: ModelInputs) -> None:
        self.send(("step", inputs.to("cpu")))

    def send(self, message: tuple) -> None:
        if self._queue is None:
            broadcast_object(message, self.group)
            return
        self._raise_error()
        self._queue.put(message)

    def flush(self) -> None:
        """Return once every message sent so far is broadcast (each broadcast has the group's timeout)."""
        if self._queue is not None:
            self._queue.join()
            self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"broadcasting a step to the workers failed: {self._error}") from self._error

    def _send_in_order(self) -> None:
        while True:
            message = self._queue.get()
            try:
                if self._error is None:
                    broadcast_object(message, self.group)
            except BaseException as exc:  # kept for the engine's thread to raise
                self._error = exc
            finally:
                self._queue.task_done()


class TensorParallelEngine(LLMEngine):
    """LLMEngine over `tp_size` ranks (rank 0 = this process). Same step-level API, plus shutdown()
    and use as a context manager; honours the same EngineConfig (CUDA graphs excepted: they would
    capture the collectives without the workers, so it runs eagerly).

    timeout_s: how long a collective may wait for a worker before the step fails;
    startup_timeout_s: how long to wait for all workers to join;
    ep_size: 1, or tp_size for expert parallelism (a MoE model's experts whole on each rank, tokens
    dispatched to them with all-to-alls; docs/expert_parallel.md);
    pp_size: pipeline stages (tp_size x pp_size ranks in all; docs/pipeline_parallel.md);
    micro_batches: under pipeline parallelism, how many micro-batches (of whole sequences) a step is
    split into at most (None: 1 with lanes, else pp_size);
    lanes: under pipeline parallelism, how many scheduler steps are in flight at once, each over its
    own share of the requests (kiln.distributed.pipeline_lanes; None: pp_size, or 1 with speculative
    decoding, whose proposer works step by step).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        tp_size: int = 2,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        ep_size: int = 1,
        pp_size: int = 1,
        micro_batches: int | None = None,
        lanes: int | None = None,
    ):
        config = config or EngineConfig()
        lanes = lane_count(lanes, pp_size, config.max_num_seqs, config.speculative is not None)
        self.lanes = lanes
        self._in_flight: list = [None] * lanes
        self._next_lane = 0
        if tp_size < 1 or pp_size < 1 or tp_size * pp_size < 2:
            raise ValueError(
                f"TensorParallelEngine: tp_size={tp_size} x pp_size={pp_size}, expected at least 2 ranks "
                "(use LLMEngine for 1)"
            )
        if pp_size > 1 and ep_size > 1:
            raise ValueError(
                "TensorParallelEngine: expert parallelism under pipeline parallelism is not supported"
            )
        device = config.resolved_device()
        check_ep_size(tp_size, ep_size)
        self.tp_size, self.ep_size, self.pp_size = tp_size, ep_size, pp_size
        self.micro_batches = micro_batches or (1 if lanes > 1 else pp_size)
        self.timeout_s = timeout_s
        self.workers = []
        self.group = None
        self._closed = False
        self._saved_threads = None
        atexit.register(self.shutdown)
        try:
            # fail on an unsplittable model before any process starts
            checkpoint = open_checkpoint(config.model, device, config.dtype)
            setup = {"engine_config": config, "path": checkpoint.path}
            if tp_size > 1:  # whole GGUF blocks of down_proj on every rank: decided once, here
                setup["intermediate_unit"] = intermediate_unit(checkpoint.config, checkpoint.weights)
                unit_config = with_intermediate_unit(checkpoint.config, setup["intermediate_unit"])
                checkpoint = dataclasses.replace(checkpoint, config=unit_config)
            check_expert_parallel(checkpoint.config, ep_size)
            ShardPlan(checkpoint.config, tp_size)
            stages = check_pipeline_parallel(checkpoint.config, pp_size)
            if pp_size > 1:
                layout = pipeline_layout(tp_size, pp_size, stages, checkpoint.config.num_layers)
                setup.update(stages=stages, micro_batches=self.micro_batches)
            else:
                layout = rank_layout(tp_size, ep_size, routed_experts(checkpoint.config))
            print(f"kiln: {layout}", file=sys.stderr, flush=True)
            self._start_workers(tp_size * pp_size, device, timeout_s, startup_timeout_s)
            loaded, num_blocks = self._set_up_ranks(setup, config, checkpoint, device)
            config = dataclasses.replace(config, num_kv_blocks=num_blocks, enforce_eager=True)
            runner_class = ModelRunner
            if pp_size > 1:
                runner_class = functools.partial(
                    PipelineStageRunner, group=self.group, micro_batches=self.micro_batches
                )
            self.broadcaster = StepBroadcaster(self.group, background=lanes > 1)
            super().__init__(
                config, loaded=loaded, before_forward=self.broadcaster, runner_class=runner_class
            )
            if lanes > 1:
                self.scheduler = LaneScheduler(
                    [self.new_scheduler(n) for n in lane_max_num_seqs(config.max_num_seqs, lanes)]
                )
        except BaseException:
            self.shutdown()
            raise

    def _set_up_ranks(self, setup: dict, config: EngineConfig, checkpoint, device) -> tuple[LoadedModel, int]:
        """Send every rank the setup, load rank 0's shard (its pipeline stage's) and agree on the KV
        block count: (rank 0's model, the block count). TensorParallelError naming the rank when a rank
        fails to load, or when a worker dies meanwhile (gloo then reports only a reset connection)."""
        try:
            broadcast_object(setup, self.group, setup=True)
            error, loaded, num_blocks = None, None, 0
            try:
                if self.pp_size > 1:
                    tp_group, stage = self.group.tp, setup["stages"][0]
                    loaded, num_blocks = load_stage(config, checkpoint, device, tp_group, stage)
                else:
                    loaded, num_blocks = load_shard(config, checkpoint, device, self.group)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                num_blocks = agree_on_blocks(error, num_blocks, self.group)
        except TensorParallelError:
            raise
        except RuntimeError as exc:
            dead = self._reap_dead_workers()
            if dead:
                raise TensorParallelError(f"tensor-parallel worker died during start-up: {dead}") from exc
            raise TensorParallelError(f"tensor parallel start-up: the setup exchange failed: {exc}") from exc
        return loaded, num_blocks

    # ---- processes ----
    def _join(self, world, device_type, init_method, timeout_s, local_rank, startup_timeout_s):
        return join_groups(
            0, world, device_type, init_method, timeout_s, local_rank, ep_size=self.ep_size,
            pp_size=self.pp_size, startup_timeout_s=startup_timeout_s,
        )  # fmt: skip

    def _start_workers(self, tp_size, device, timeout_s, startup_timeout_s) -> None:
        # tp_size here: every rank of the world (tp_size x pp_size)
        if launched_by_torchrun():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if rank != 0 or world != tp_size:
                raise ValueError(
                    f"TensorParallelEngine: under torchrun this must be RANK 0 of WORLD_SIZE {tp_size}, got "
                    f"RANK {rank} of {world} (other ranks run kiln.distributed.worker.torchrun_main)"
                )
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            store = torchrun_store(0, world, startup_timeout_s)
            agree_on_device_type(store, 0, device.type)  # the other ranks pick their backend from it
            self.group = self._join(world, device.type, store, timeout_s, local_rank, startup_timeout_s)
            return
        check_local_devices(device.type, tp_size)
        threads = None
        if device.type == "cpu":
            # the ranks share this machine's cores
            threads = max(1, (os.cpu_count() or 1) // tp_size)
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = torch.multiprocessing.get_context("spawn")
        for rank in range(1, tp_size):
            process = context.Process(
                target=spawn_main,
                args=(
                    rank,
                    tp_size,
                    init_method,
                    device.type,
                    timeout_s,
                    threads,
                    self.ep_size,
                    self.pp_size,
                ),
                name=f"kiln-tp-worker-{rank}",
                daemon=True,
            )
            process.start()
            self.workers.append(process)
        self.group = self._join_watching_workers(
            tp_size, device.type, init_method, timeout_s, startup_timeout_s
        )

    def _join_watching_workers(self, world, device_type, init_method, timeout_s, startup_timeout_s):
        """_join from a thread while this one watches the spawned workers: a worker that exits before
        every rank has joined (a failed import, a missing GPU, killed) is a TensorParallelError naming
        it at once, instead of a rendezvous timeout after startup_timeout_s that names nobody. The
        thread, left waiting in the rendezvous then, ends at that timeout without effect."""
        result = {}

        def join() -> None:
            try:
                group = self._join(world, device_type, init_method, timeout_s, None, startup_timeout_s)
                result["group"] = group
            except BaseException as exc:  # raised below, in the engine's thread
                result["error"] = exc

        thread = threading.Thread(target=join, daemon=True, name="kiln-tp-join")
        thread.start()
        sentinels = [process.sentinel for process in self.workers]
        while thread.is_alive():
            multiprocessing.connection.wait(sentinels, timeout=0.1)
            dead = "; ".join(self.dead_workers())
            if dead:
                raise TensorParallelError(f"tensor-parallel worker died during start-up: {dead}")
        if "error" in result:
            raise result["error"]
        return result["group"]

    def _reap_dead_workers(self) -> str:
        """'; '.join(dead_workers()) after giving each spawned worker a second to be reaped (one
        killed a moment ago may still look alive); '' when none died."""
        for process in self.workers:
            process.join(timeout=1.0)
        return "; ".join(self.dead_workers())

    def stage_stats(self) -> list[dict]:
        """Every rank's runner stats, in rank order (pipeline parallelism: compute and point-to-point
        wait seconds per rank, see PipelineStageRunner; {} for a tensor-parallel rank)."""
        self.broadcaster.send(("stats",))
        self.broadcaster.flush()
        return all_gather_object(getattr(self.runner, "stats", {}), self.group)

    def dead_workers(self) -> list[str]:
        """'rank R (pid P) exited with code C' for every spawned worker that is no longer running."""
        return [
            f"rank {rank}{self._stage_of(rank)} (pid {p.pid}) exited with code {p.exitcode}"
            for rank, p in enumerate(self.workers, start=1)
            if p.exitcode is not None
        ]

    def _stage_of(self, rank: int) -> str:
        return f", pipeline stage {rank // self.tp_size}" if self.pp_size > 1 else ""

    def step(self) -> list[RequestOutput]:
        if self._closed:
            raise TensorParallelError("TensorParallelEngine.step: the engine has been shut down")
        dead = self.dead_workers()
        if dead:
            self.shutdown()
            raise TensorParallelError(f"tensor-parallel worker died: {'; '.join(dead)}")
        try:
            return self._lane_step() if self.lanes > 1 else super().step()
        except SamplingError:
            raise  # rank 0 could not sample some requests: the ranks are fine (see LLMEngine.step)
        except RuntimeError as exc:
            dead = self._reap_dead_workers()
            if dead:
                message = f"tensor-parallel worker died: {dead}"
            else:
                what = "collective or pipeline send/recv" if self.pp_size > 1 else "collective"
                message = (
                    f"a tensor-parallel {what} failed or did not finish within {self.timeout_s:g} s "
                    f"(a worker is hung or unreachable): {exc}"
                )
            self.shutdown(graceful=False)
            raise TensorParallelError(message) from exc
        except BaseException:
            # e.g. KeyboardInterrupt or MemoryError on rank 0 mid-step: the workers may wait in a
            # collective rank 0 left, so the ranks are out of step; a stop message would wait for them
            self.shutdown(graceful=False)
            raise

    def _lane_step(self) -> list[RequestOutput]:
        """One step of the next lane (round robin): finish its step in flight (collect the logits,
        sample, advance, detokenize), then schedule and launch its next one, which runs through the
        pipeline behind the other lanes' steps. Aborts are reported first; a step that raises keeps
        them for the next, as LLMEngine.step does."""
        return self._after_aborts(self._lane_step_outputs)

    def _lane_step_outputs(self) -> list[RequestOutput]:
        outputs = []
        self.step_times.steps += 1
        lane = self._next_lane
        self._next_lane = (lane + 1) % self.lanes
        scheduler = self.scheduler.lanes[lane]
        started, self._in_flight[lane] = self._in_flight[lane], None
        if started is not None:
            tokens, logprobs = self.runner.finish(started)
            outputs.extend(self._advance(scheduler, started.batch, tokens, logprobs))
        scheduling = time.perf_counter()
        batch = scheduler.schedule()
        self.step_times.add("schedule", time.perf_counter() - scheduling)
        if batch.seqs:
            self._in_flight[lane] = self.runner.start(batch)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or any(s is not None for s in self._in_flight)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (a stop message, then SIGKILL for any still running after 5 s) and leave
        the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.group is not None and graceful and not self.dead_workers():
            try:
                broadcaster = getattr(self, "broadcaster", None)
                if broadcaster is None:  # start-up failed before the engine was built
                    broadcast_object(("stop",), self.group)
                else:
                    broadcaster.send(("stop",))
                    broadcaster.flush()
            except Exception:  # a worker already gone: the kills below clean up
                graceful = False
        for process in self.workers:
            process.join(timeout=5.0 if graceful else 0.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        if self.group is not None:
            destroy_tp_group()
            self.group = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)

    def __enter__(self) -> TensorParallelEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
