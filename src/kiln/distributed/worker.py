"""Tensor-parallel workers (ranks 1..N-1): build this rank's shard, then replay rank 0's steps.

Protocol (rank 0 broadcasts, see engine.py; setup over the setup_group, steps over the cpu_group):
  setup: the EngineConfig and checkpoint path -> every rank builds its shard and proposes a KV block
         count; all ranks exchange (error or None, num_blocks) and use the smallest count;
  ("step", input_ids, positions, attn_metadata, sample_rows) -> model.forward (joining the
         all-reduces) and, when rows are sampled, compute_logits (joining the logits gather);
  ("stop",) -> leave the loop.
A worker started by `spawn` also watches its parent and exits when it dies (no orphans).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import threading
import traceback

import torch

from kiln.distributed.collectives import all_gather_object, broadcast_object
from kiln.distributed.groups import (
    DEFAULT_TIMEOUT_S,
    TensorParallelError,
    TPGroup,
    destroy_tp_group,
    init_tp_group,
    launched_by_torchrun,
)


def rank_device(device_type: str, group: TPGroup) -> torch.device:
    return torch.device("cuda", group.local_rank) if device_type == "cuda" else torch.device("cpu")


def build_rank(setup: dict, group: TPGroup):
    """(model, num_blocks this rank can hold) for the setup message rank 0 broadcast."""
    from kiln.distributed.model import build_shard, open_checkpoint
    from kiln.distributed.sharding import ShardPlan
    from kiln.engine.config import kv_block_bytes, num_kv_blocks_for

    config = setup["engine_config"]
    device = rank_device(setup["device_type"], group)
    checkpoint = open_checkpoint(setup["path"])
    checkpoint.config.eos_token_ids = list(setup["eos_token_ids"])
    plan = ShardPlan(checkpoint.config, group.world_size)
    model = build_shard(checkpoint, plan, group, device, setup["dtype"])
    c = model.config
    block_bytes = kv_block_bytes(
        c.num_layers, config.block_size, c.num_kv_heads, c.head_dim, model.kv_cache_dtype
    )
    return model, num_kv_blocks_for(config, device, block_bytes)


def agree_on_blocks(error: str | None, num_blocks: int, group: TPGroup) -> int:
    """Exchange every rank's (error, num_blocks); raise TensorParallelError naming the first failed rank,
    else return the smallest block count (the ranks' caches must match block for block)."""
    reports = all_gather_object((error, num_blocks), group)
    for rank, (err, _) in enumerate(reports):
        if err is not None:
            raise TensorParallelError(f"tensor parallel: rank {rank} failed to load its shard:\n{err}")
    return min(n for _, n in reports)


def serve_steps(model, kv_caches, group: TPGroup, device: torch.device) -> None:
    """Replay rank 0's steps until it says stop."""
    with torch.inference_mode():
        while True:
            msg = broadcast_object(None, group)
            if msg[0] == "stop":
                return
            _, input_ids, positions, metadata, sample_rows = msg
            if device.type != "cpu":
                input_ids, positions = input_ids.to(device), positions.to(device)
                metadata = dataclasses.replace(
                    metadata,
                    **{
                        f.name: getattr(metadata, f.name).to(device)
                        for f in dataclasses.fields(metadata)
                        if isinstance(getattr(metadata, f.name), torch.Tensor)
                    },
                )
            hidden = model.forward(input_ids, positions, kv_caches, metadata)
            if sample_rows:
                if len(sample_rows) != hidden.shape[0]:
                    hidden = hidden[torch.tensor(sample_rows, device=hidden.device)]
                model.compute_logits(hidden)


def run_worker(group: TPGroup, device_type: str) -> None:
    """Everything a worker rank does after joining the group."""
    setup = broadcast_object(None, group, setup=True)
    model, num_blocks, error = None, 0, None
    try:
        model, num_blocks = build_rank(setup, group)
    except Exception:
        error = traceback.format_exc()
    num_blocks = agree_on_blocks(error, num_blocks, group)
    device = rank_device(device_type, group)
    c = model.config
    shape = (num_blocks, setup["engine_config"].block_size, c.num_kv_heads, c.head_dim)
    kv_caches = [
        (torch.zeros(shape, dtype=model.kv_cache_dtype, device=device),
         torch.zeros(shape, dtype=model.kv_cache_dtype, device=device))
        for _ in range(c.num_layers)
    ]  # fmt: skip
    serve_steps(model, kv_caches, group, device)


def _exit_when_parent_dies() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()  # returns when the parent's sentinel closes, i.e. it exited or was killed
        os._exit(1)


def spawn_main(rank: int, world_size: int, init_method: str, device_type: str, timeout_s: float,
               num_threads: int | None) -> None:  # fmt: skip
    """Entry point of a worker started with torch.multiprocessing (spawn) by TensorParallelEngine."""
    threading.Thread(target=_exit_when_parent_dies, daemon=True, name="kiln-tp-watchdog").start()
    if num_threads:
        torch.set_num_threads(num_threads)
    group = init_tp_group(rank, world_size, device_type, init_method, timeout_s)
    try:
        run_worker(group, device_type)
    except Exception as exc:
        print(f"kiln tensor-parallel worker rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)
    destroy_tp_group()


def torchrun_main(timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """A rank > 0 started by torchrun (env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):
    join the group and serve rank 0 until it stops. Returns the process exit code."""
    if not launched_by_torchrun():
        raise RuntimeError("torchrun_main: RANK / WORLD_SIZE are not set (start it with torchrun)")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    group = init_tp_group(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        device_type,
        "env://",
        timeout_s,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    try:
        run_worker(group, device_type)
    finally:
        destroy_tp_group()
    return 0
