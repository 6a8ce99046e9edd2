"""The collectives tensor parallelism uses, with the group's timeout (see groups.py).

(The TP group spans the whole world, so group rank 0 is global rank 0.)
all_reduce:        sum of a tensor over the ranks, in place (activations, [T, hidden]).
gather_to_first:   rank 0 gets every rank's [N, n_r] slice (uneven n_r: padded for the wire).
broadcast_object / all_gather_object: picklable control messages over the gloo groups.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from kiln.distributed.groups import TPGroup


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


def all_reduce(tensor: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sums `tensor` over the ranks in place and returns it (no-op for one rank)."""
    if group.world_size == 1:
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


def gather_to_first(tensor: torch.Tensor, sizes: list[int], group: TPGroup) -> list[torch.Tensor] | None:
    """tensor [N, sizes[rank]] on every rank -> on rank 0 the list of all ranks' tensors (rank order),
    elsewhere None. The ranks pad to max(sizes) columns because gather needs equal shapes."""
    if group.world_size == 1:
        return [tensor]
    width = max(sizes)
    if tensor.shape[-1] != width:
        tensor = torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in sizes] if group.rank == 0 else None
    dist.gather(tensor, parts, dst=0, group=group.device_group)
    if parts is None:
        return None
    return [p[..., :n] for p, n in zip(parts, sizes, strict=True)]


def broadcast_object(obj: Any, group: TPGroup, setup: bool = False) -> Any:
    """Rank 0's `obj` on every rank (pickled; tensors inside should be on the CPU), over the cpu_group,
    or the setup_group when `setup`."""
    box = [obj if group.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group.setup_group if setup else group.cpu_group)
    return box[0]


def all_gather_object(obj: Any, group: TPGroup) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (over the setup_group)."""
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.setup_group)
    return out
