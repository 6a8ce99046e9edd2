"""The tensor-parallel group as the layers see it, and the two collectives they run.

A layer built with `tp_group=None` runs in a single process and never communicates; built with a
`TPGroup` it holds this rank's slice of the weights and joins the group's collectives:

    all_reduce:       sum of a tensor over the ranks, in place (activations, [T, hidden]), after
                      o_proj / down_proj (row-parallel) and the vocab-parallel embedding;
    gather_to_first:  rank 0 gets every rank's [N, n_r] slice (the vocab-parallel LM head's logits).

Both call torch.distributed directly on `group.device_group` (NCCL on GPUs, gloo on CPUs). Creating
the groups, spawning the processes and the control messages between them are kiln.distributed's job
(which imports this module; nothing here imports kiln.distributed).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group (kiln.distributed.groups.init_tp_group
    makes one). The group spans the whole world, so group rank 0 is global rank 0, which drives.

    device_group: the activations' collectives; cpu_group / setup_group: gloo groups for rank 0's
    per-step and one-off control messages; timeout_s: how long a collective may wait for a rank.
    """

    rank: int
    world_size: int
    local_rank: int
    device_group: object
    cpu_group: object
    setup_group: object
    timeout_s: float

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


class CollectiveTimer:
    """Wall time this process spends in all_reduce (CUDA: synchronized, so it is the real cost)."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0


_timer: CollectiveTimer | None = None


@contextmanager
def time_all_reduces():
    """`with time_all_reduces() as timer:` ... timer.seconds, timer.calls (for benchmarks)."""
    global _timer
    _timer = CollectiveTimer()
    try:
        yield _timer
    finally:
        _timer = None


def all_reduce(tensor: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    """Sums `tensor` over the ranks in place and returns it (no-op without a group or for one rank)."""
    if group is None or group.world_size == 1:
        return tensor
    if _timer is None:
        dist.all_reduce(tensor, group=group.device_group)
        return tensor
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    start = time.perf_counter()
    dist.all_reduce(tensor, group=group.device_group)
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    _timer.seconds += time.perf_counter() - start
    _timer.calls += 1
    return tensor


def gather_to_first(
    tensor: torch.Tensor, sizes: list[int], group: TPGroup | None
) -> list[torch.Tensor] | None:
    """tensor [N, sizes[rank]] on every rank -> on rank 0 the list of all ranks' tensors (rank order),
    elsewhere None. The ranks pad to max(sizes) columns because gather needs equal shapes."""
    if group is None or group.world_size == 1:
        return [tensor]
    width = max(sizes)
    if tensor.shape[-1] != width:
        tensor = torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in sizes] if group.rank == 0 else None
    # group_dst: group rank 0 (a pipeline stage's TP group does not contain global rank 0)
    dist.gather(tensor, parts, group=group.device_group, group_dst=0)
    if parts is None:
        return None
    return [p[..., :n] for p, n in zip(parts, sizes, strict=True)]
