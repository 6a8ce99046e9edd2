"""rank 0's control messages to the tensor-parallel workers (picklable objects over the gloo groups).

broadcast_object:   rank 0's object on every rank (each step's inputs, setup, stop);
all_gather_object:  every rank's object on every rank (the setup exchange).
The collectives on activations (all_reduce, gather_to_first, and `time_all_reduces` for benchmarks)
are the layers', in kiln.models.layers.tp.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from kiln.models.layers.tp import TPGroup

__all__ = ["all_gather_object", "broadcast_object"]


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
