"""Tensor-parallel workers (ranks 1..N-1): build this rank's shard, then replay rank 0's steps.

Protocol (rank 0 broadcasts, see engine.py; setup over the setup_group, steps over the cpu_group):
  setup: the EngineConfig and checkpoint path (and under TP the MLP's split unit, which rank 0 read
         from the checkpoint) -> every rank loads its shard (kiln.loaders.load_model with the group:
         the same options on every rank) and proposes a KV block count; all ranks exchange (error or
         None, num_blocks) and use the smallest count;
  ("step", ModelInputs) -> ModelRunner.execute: the forward pass (joining the all-reduces) and, when
         rows are sampled, compute_logits (joining the logits gather);
  ("stats",) -> every rank's runner stats gathered (pipeline stages' compute / point-to-point wait
         times, for the benchmark);
  ("stop",) -> leave the loop.
Under pipeline parallelism (pp_size > 1, groups from init_pipeline_group) the setup also names each
stage's layers and the micro-batch count; each rank builds only its stage (load_stage) and replays
the steps through a PipelineStageRunner (kiln.distributed.stage_runner).
A worker started by `spawn` also watches its parent and exits when it dies (no orphans); one started
by torchrun takes rank 0's device type from the rendezvous store before it joins (torchrun_main).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import threading
import traceback

import torch
import torch.distributed as dist

from kiln.distributed.collectives import all_gather_object, broadcast_object
from kiln.distributed.groups import (
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    PipelineGroup,
    TensorParallelError,
    TPGroup,
    agree_on_device_type,
    destroy_tp_group,
    init_pipeline_group,
    init_tp_group,
    launched_by_torchrun,
    torchrun_store,
)
from kiln.distributed.stage_runner import PipelineStageRunner
from kiln.engine.config import EngineConfig, exact_kv_layout_for, kv_cache_dtype_for, num_kv_blocks_for_model
from kiln.engine.kv_scales import engine_kv_calibration
from kiln.engine.model_runner import ModelRunner
from kiln.loaders import Checkpoint, LoadedModel, load_model, open_checkpoint
from kiln.models.sharding import with_intermediate_unit


def rank_device(device_type: str, group: TPGroup | PipelineGroup) -> torch.device:
    return torch.device("cuda", group.local_rank) if device_type == "cuda" else torch.device("cpu")


def load_shard(
    config: EngineConfig,
    model: str | Checkpoint,
    device: torch.device,
    group: TPGroup | None,
    layers: tuple[int, int] | None = None,
    intermediate_unit: int | None = None,
) -> tuple[LoadedModel, int]:
    """(this rank's shard of the model, the KV blocks this rank can hold): what every rank, rank 0
    included, loads, with the engine config's options. layers: (start, end), build only that pipeline
    stage's decoder layers (group: the stage's TP group, or None). intermediate_unit: the MLP's split
    unit rank 0 chose (kiln.models.sharding.intermediate_unit; None: the checkpoint's config as it is).
    Formats: the engine config's, else the checkpoint's defaults (no timed probe: ranks timing at once
    measure noise)."""
    if intermediate_unit is not None:
        if not isinstance(model, Checkpoint):
            model = open_checkpoint(model, device, config.dtype)
        unit_config = with_intermediate_unit(model.config, intermediate_unit)
        model = dataclasses.replace(model, config=unit_config)
    loaded = load_model(
        model,
        device,
        config.dtype,
        cpu_format=config.cpu_format,
        lm_head_format=config.lm_head_format,
        tp_group=group,
        pipeline_layers=layers,
        expert_format=config.expert_format,
    )
    return loaded, num_kv_blocks_for_model(config, device, loaded.model)


def load_stage(
    config: EngineConfig,
    model: str | Checkpoint,
    device: torch.device,
    tp_group: TPGroup | None,
    layers: tuple[int, int],
) -> tuple[LoadedModel, int]:
    """(this rank's pipeline stage: decoder layers [start, end), its TP shard when tp_group is given;
    the KV blocks this rank can hold for those layers); see load_shard."""
    return load_shard(config, model, device, tp_group, layers)


def agree_on_blocks(error: str | None, num_blocks: int, group: TPGroup | PipelineGroup) -> int:
    """Exchange every rank's (error, num_blocks); raise TensorParallelError naming the first failed rank,
    else return the smallest block count (the ranks' caches must match block for block)."""
    reports = all_gather_object((error, num_blocks), group)
    for rank, (err, _) in enumerate(reports):
        if err is not None:
            raise TensorParallelError(f"tensor parallel: rank {rank} failed to load its shard:\n{err}")
    return min(n for _, n in reports)


def serve_steps(runner: ModelRunner, group: TPGroup | PipelineGroup, device: torch.device) -> None:
    """Replay rank 0's steps until it says stop."""
    while True:
        msg = broadcast_object(None, group)
        if msg[0] == "stop":
            return
        if msg[0] == "stats":
            all_gather_object(getattr(runner, "stats", {}), group)
            continue
        runner.execute(msg[1].to(device))


def join_groups(
    rank: int, world_size: int, device_type: str, init_method: str | dist.Store, timeout_s: float,
    local_rank: int | None = None, ep_size: int = 1, pp_size: int = 1,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> TPGroup | PipelineGroup:  # fmt: skip
    """init_tp_group, or init_pipeline_group when pp_size > 1 (tp = world_size / pp_size)."""
    if pp_size > 1:
        return init_pipeline_group(
            rank, world_size // pp_size, pp_size, device_type, init_method, timeout_s, local_rank,
            startup_timeout_s=startup_timeout_s,
        )  # fmt: skip
    return init_tp_group(
        rank, world_size, device_type, init_method, timeout_s, local_rank,
        startup_timeout_s=startup_timeout_s, ep_size=ep_size,
    )  # fmt: skip


def run_rank(group: TPGroup | PipelineGroup, device_type: str) -> None:
    """Everything a rank other than 0 does after joining the groups: load its shard (its pipeline
    stage under pipeline parallelism), agree on the KV block count, then replay rank 0's steps."""
    setup = broadcast_object(None, group, setup=True)
    config: EngineConfig = setup["engine_config"]
    device = rank_device(device_type, group)
    pipeline = isinstance(group, PipelineGroup)
    loaded, num_blocks, error = None, 0, None
    try:
        tp_group, layers = (group.tp, setup["stages"][group.stage]) if pipeline else (group, None)
        unit = setup.get("intermediate_unit")
        loaded, num_blocks = load_shard(config, setup["path"], device, tp_group, layers, unit)
    except Exception:
        error = traceback.format_exc()
    num_blocks = agree_on_blocks(error, num_blocks, group)
    kv_cache_dtype = kv_cache_dtype_for(config, loaded.model)
    # rank 0 calibrates at this point of its LLMEngine start-up too
    kv_calibration = engine_kv_calibration(
        config, loaded.model, loaded.tokenizer, kv_cache_dtype, pipeline, checkpoint_scales=loaded.kv_scales
    )
    # rank 0's runner has the same cache; only CUDA graphs would read max_model_len, and TP runs eagerly
    stage_args = {"group": group, "micro_batches": setup["micro_batches"]} if pipeline else {}
    runner = (PipelineStageRunner if pipeline else ModelRunner)(
        loaded.model,
        device,
        num_blocks,
        config.block_size,
        config.max_num_seqs,
        max_model_len=num_blocks * config.block_size,
        enforce_eager=True,
        kv_cache_dtype=kv_cache_dtype,
        **stage_args,
        kv_calibration=kv_calibration,
        exact_kv=exact_kv_layout_for(config, kv_cache_dtype),
    )
    serve_steps(runner, group, device)


def _exit_when_parent_dies() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()  # returns when the parent's sentinel closes, i.e. it exited or was killed
        os._exit(1)


def spawn_main(rank: int, world_size: int, init_method: str, device_type: str, timeout_s: float,
               num_threads: int | None, ep_size: int = 1, pp_size: int = 1) -> None:  # fmt: skip
    """Entry point of a worker started with torch.multiprocessing (spawn) by TensorParallelEngine
    (ep_size, pp_size: the engine's, see init_tp_group / init_pipeline_group)."""
    threading.Thread(target=_exit_when_parent_dies, daemon=True, name="kiln-tp-watchdog").start()
    if num_threads:
        torch.set_num_threads(num_threads)
    group = join_groups(
        rank, world_size, device_type, init_method, timeout_s, ep_size=ep_size, pp_size=pp_size
    )
    try:
        run_rank(group, device_type)
    except Exception as exc:
        print(f"kiln parallel worker rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)
    destroy_tp_group()


def torchrun_main(timeout_s: float = DEFAULT_TIMEOUT_S, ep_size: int = 1, pp_size: int = 1) -> int:
    """A rank > 0 started by torchrun (env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):
    join the groups (ep_size, pp_size as rank 0's) and serve rank 0 until it stops. Returns the exit
    code."""
    if not launched_by_torchrun():
        raise RuntimeError("torchrun_main: RANK / WORLD_SIZE are not set (start it with torchrun)")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = torchrun_store(rank, world_size, DEFAULT_STARTUP_TIMEOUT_S)
    # rank 0's configured device, not whether this machine has a GPU: the ranks' backends must match
    device_type = agree_on_device_type(store, rank, None)
    group = join_groups(
        rank,
        world_size,
        device_type,
        store,
        timeout_s,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        ep_size=ep_size,
        pp_size=pp_size,
    )
    try:
        run_rank(group, device_type)
    finally:
        destroy_tp_group()
    return 0
