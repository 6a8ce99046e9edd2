"""Process groups for tensor parallelism: one per process, rank 0 drives the engine.

Three gloo/NCCL groups over the same ranks:
  - `device_group` (NCCL on GPUs, gloo on CPUs) carries the activations: the all-reduces after
    o_proj / down_proj / the embedding and the logits gather. Its timeout is short (`timeout_s`):
    a worker that dies or hangs turns the next collective into an error instead of a hang.
  - `cpu_group` (gloo) carries each step's batch and the stop message from rank 0. A gloo timeout
    is local to each process, so rank 0's is short (a broadcast to a hung worker fails after
    `timeout_s`) while the workers', who wait there while the engine is idle, is long
    (`idle_timeout_s`); a dead rank 0 still ends their wait at once (its connections close), and
    spawned workers also watch their parent.
  - `setup_group` (gloo, `startup_timeout_s`) carries the one-off setup exchange (loading a shard may
    take long on some rank).

With expert parallelism (`ep_size` = the world size: MoE layers hold whole experts, everything else
is split as under tensor parallelism) a fourth group, `expert_group` (same backend and timeout as
device_group), carries the MoE layers' token all-to-alls and all-gathers; the handle is then an
ExpertParallelGroup (kiln.models.layers.expert_parallel).

The group handle (`TPGroup`) and the collectives the layers run live below the models, in
kiln.models.layers.tp and expert_parallel; this module creates and destroys the groups and describes
the rank layout (`rank_layout`, printed by rank 0 at start-up).

With pipeline parallelism (`init_pipeline_group`, tp_size x pp_size ranks, global rank =
stage * tp_size + tp_rank) the groups are built once, here: cpu_group and setup_group over every rank
as above; one tensor-parallel device group per stage (the TPGroup its layers are built with); and
`pipe_group` (device backend, every rank, `timeout_s`) for the point-to-point sends of hidden states
between neighbouring stages and of the logits from the last stage back to rank 0.

Rendezvous: spawned workers use tcp://127.0.0.1:<free port> (rank 0 passes them its device type);
under torchrun the standard env vars (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK) give the
rendezvous store (`torchrun_store`), through which rank 0 tells the others its device type before the
backend is chosen (a rank > 0 does not know the configured device before the setup message).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.models.layers.expert_parallel import ExpertParallelGroup
from kiln.models.layers.tp import TPGroup

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_IDLE_TIMEOUT_S = 20 * 24 * 3600.0  # gloo keeps milliseconds in 32 bits somewhere: stay < 24.8 days
DEFAULT_STARTUP_TIMEOUT_S = 600.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, hung past the collective timeout, or failed to start."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for single-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_by_torchrun() -> bool:
    """True when torchrun (or any launcher that sets RANK and WORLD_SIZE) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def check_local_devices(device_type: str, world_size: int) -> None:
    """ValueError unless this machine has a GPU for each of `world_size` ranks spawned on it (rank r
    binds cuda:r); checked before any process starts."""
    if device_type != "cuda":
        return
    count = torch.cuda.device_count()
    if count < world_size:
        raise ValueError(
            f"parallel engine: {world_size} ranks on this machine need {world_size} GPUs (rank r uses "
            f"cuda:r), torch sees {count}; use fewer ranks (--tp x --pp <= {count}), or torchrun over "
            "several machines"
        )


DEVICE_TYPE_KEY = "kiln/device_type"


def torchrun_store(rank: int, world_size: int, startup_timeout_s: float) -> dist.Store:
    """The env:// rendezvous store of a torchrun launch (MASTER_ADDR / MASTER_PORT; torchrun's agent
    store, or one hosted by rank 0), to build the process group on (join_world) and to agree on the
    device type (agree_on_device_type) first."""
    timeout = timedelta(seconds=startup_timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return store


def agree_on_device_type(store: dist.Store, rank: int, device_type: str | None) -> str:
    """Rank 0's device type on every rank: rank 0 publishes `device_type` (its configured device's),
    the others wait for it (up to the store's timeout) and ignore their own guess, so every rank picks
    the same backend (a rank that sees a GPU must not pick NCCL when rank 0 runs on the CPU)."""
    if rank == 0:
        if device_type is None:
            raise ValueError("agree_on_device_type: rank 0 must give its device type")
        store.set(DEVICE_TYPE_KEY, device_type)
        return device_type
    return store.get(DEVICE_TYPE_KEY).decode()


def init_tp_group(
    rank: int,
    world_size: int,
    device_type: str,
    init_method: str | dist.Store,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    local_rank: int | None = None,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ep_size: int = 1,
) -> TPGroup:
    """Join the group: blocks until all `world_size` ranks have joined (RuntimeError after
    startup_timeout_s). On CUDA, binds this process to cuda:<local_rank> first. ep_size: 1, or
    world_size for expert parallelism (an ExpertParallelGroup with its expert_group)."""
    check_ep_size(world_size, ep_size)
    local_rank = join_world(
        "tensor parallel", rank, world_size, device_type, init_method, local_rank, startup_timeout_s
    )
    ranks = list(range(world_size))
    device_group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
    cpu_group, setup_group = control_groups(rank, world_size, timeout_s, idle_timeout_s, startup_timeout_s)
    if ep_size > 1:
        expert_group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
        return ExpertParallelGroup(
            rank, world_size, local_rank, device_group, cpu_group, setup_group, timeout_s, expert_group
        )
    return TPGroup(rank, world_size, local_rank, device_group, cpu_group, setup_group, timeout_s)


def join_world(
    what: str,
    rank: int,
    world_size: int,
    device_type: str,
    init_method: str | dist.Store,
    local_rank: int | None,
    startup_timeout_s: float,
) -> int:
    """Initialise torch.distributed for this rank (blocks until all `world_size` ranks have joined;
    RuntimeError after startup_timeout_s, or at once when this process already belongs to a group;
    `what` names the kind of engine in that message). init_method: a URL, or a rendezvous store
    (torchrun_store). On CUDA, binds this process to cuda:<local_rank> first. Returns local_rank
    (default: rank)."""
    if dist.is_initialized():
        raise RuntimeError(
            f"{what}: this process already belongs to a torch.distributed group; shut the other "
            "parallel engine down first (one per process)"
        )
    local_rank = rank if local_rank is None else local_rank
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if isinstance(init_method, str):
        rendezvous = {"init_method": init_method}
    else:  # the prefix init_process_group puts on a store it makes itself
        rendezvous = {"store": dist.PrefixStore("default_pg", init_method)}
    dist.init_process_group(
        backend=backend_for(device_type),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=startup_timeout_s),
        **rendezvous,
    )
    return local_rank


def control_groups(
    rank: int, world_size: int, timeout_s: float, idle_timeout_s: float, startup_timeout_s: float
) -> tuple[object, object]:
    """(cpu_group, setup_group): gloo groups over every rank for rank 0's per-step messages (timeout_s
    on rank 0, idle_timeout_s on the others, who wait there while the engine is idle) and its one-off
    setup exchange (startup_timeout_s). Collective: every rank calls it at the same point."""
    ranks = list(range(world_size))
    cpu_timeout = timeout_s if rank == 0 else idle_timeout_s
    cpu_group = dist.new_group(ranks, timeout=timedelta(seconds=cpu_timeout), backend="gloo")
    setup_group = dist.new_group(ranks, timeout=timedelta(seconds=startup_timeout_s), backend="gloo")
    return cpu_group, setup_group


def check_ep_size(world_size: int, ep_size: int) -> None:
    """ValueError unless ep_size is 1 (no expert parallelism) or the world size (experts spread whole
    over every rank; attention and dense layers tensor-parallel over the same ranks)."""
    if ep_size not in (1, world_size):
        raise ValueError(
            f"expert parallel: ep={ep_size} over {world_size} ranks; expert parallelism spans every rank "
            f"(attention and dense layers tensor-parallel over the same ranks), so use --ep {world_size} "
            f"(or --ep alone, which sets the rank count)"
        )


def rank_layout(world_size: int, ep_size: int = 1, num_experts: int = 0) -> str:
    """A line saying what each rank holds (printed by rank 0 at start-up)."""
    text = f"{world_size} ranks, tensor parallel: attention heads, dense MLP columns and vocabulary split"
    if ep_size > 1:
        per_rank = num_experts // ep_size
        held = ", ".join(
            f"rank {r}: experts {r * per_rank}-{(r + 1) * per_rank - 1}" for r in range(world_size)
        )
        return f"{text}; expert parallel over the same ranks ({held})"
    if num_experts:
        text += f"; each of the {num_experts} experts split along its intermediate size"
    return text


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class PipelineGroup:
    """This process's place in a tp_size x pp_size layout (init_pipeline_group makes one). Global rank
    = stage * tp_size + tp_rank; global rank 0 (stage 0, TP rank 0) drives the engine.

    tp: this stage's TPGroup (its layers' all-reduces and logits gather), None when tp_size == 1;
    pipe_group: point-to-point activations and logits (NCCL on GPUs, gloo on CPUs);
    cpu_group / setup_group: gloo over every rank, rank 0's per-step and one-off messages (the
    attribute names kiln.distributed.collectives reads, with `rank` and `world_size` global).
    """

    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    pp_size: int
    tp: TPGroup | None
    pipe_group: object
    cpu_group: object
    setup_group: object
    timeout_s: float

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    def global_rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    @property
    def prev_rank(self) -> int | None:
        """The rank this one receives hidden states from (same TP rank, previous stage)."""
        return None if self.stage == 0 else self.global_rank(self.stage - 1, self.tp_rank)

    @property
    def next_rank(self) -> int | None:
        """The rank this one sends hidden states to (same TP rank, next stage)."""
        return None if self.stage == self.pp_size - 1 else self.global_rank(self.stage + 1, self.tp_rank)

    @property
    def sends_logits(self) -> bool:
        """True on the rank that sends each step's logits to rank 0: the last stage's TP rank 0."""
        return self.stage == self.pp_size - 1 and self.tp_rank == 0


def init_pipeline_group(
    rank: int,
    tp_size: int,
    pp_size: int,
    device_type: str,
    init_method: str | dist.Store,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    local_rank: int | None = None,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> PipelineGroup:
    """Join a tp_size x pp_size world (blocks until every rank has joined) and build all its groups
    once, in the same order on every rank."""
    world_size = tp_size * pp_size
    local_rank = join_world(
        "pipeline parallel", rank, world_size, device_type, init_method, local_rank, startup_timeout_s
    )
    timeout = timedelta(seconds=timeout_s)
    cpu_group, setup_group = control_groups(rank, world_size, timeout_s, idle_timeout_s, startup_timeout_s)
    pipe_group = dist.new_group(list(range(world_size)), timeout=timeout)
    tp = None
    for stage in range(pp_size):  # every rank creates every stage's group (new_group is collective)
        members = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(members, timeout=timeout) if tp_size > 1 else None
        if rank in members and group is not None:
            tp = TPGroup(rank - members[0], tp_size, local_rank, group, None, None, timeout_s)
    return PipelineGroup(
        rank, world_size, local_rank, tp_size, pp_size, tp, pipe_group, cpu_group, setup_group,
        timeout_s,
    )  # fmt: skip


def pipeline_layout(tp_size: int, pp_size: int, stages: list[tuple[int, int]], num_layers: int) -> str:
    """Lines saying what each rank holds under TP x PP (printed by rank 0 at start-up)."""
    split = "+".join(str(end - start) for start, end in stages)
    even = "even" if len({end - start for start, end in stages}) == 1 else "uneven"
    lines = [
        f"{tp_size * pp_size} ranks = {pp_size} pipeline stages x {tp_size} tensor-parallel; "
        f"{num_layers} decoder layers split {split} ({even})"
    ]
    for stage, (start, end) in enumerate(stages):
        ranks = ", ".join(str(stage * tp_size + t) for t in range(tp_size))
        parts = [f"layers {start}-{end - 1}"]
        if stage == 0:
            parts.insert(0, "embedding")
        if stage == pp_size - 1:
            parts.append("final norm + LM head")
        lines.append(f"  stage {stage}: ranks {ranks}: {', '.join(parts)}")
    return "\n".join(lines)
