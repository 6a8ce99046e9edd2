"""Row-parallel linear layer (Megatron-style), W in the checkpoint's [out_features, in_features] layout.

Tensor parallelism splits a pair of projections so that only the second one communicates:
  - column-parallel (q/k/v, gate/up): rank r keeps rows [n0, n1) of W, its slice of the outputs; the
    output stays sharded and nothing is exchanged, so these are plain `Linear`s over the rank's rows;
  - row-parallel (attention o_proj, MLP down_proj): rank r keeps columns [k0, k1) of W and consumes
    the matching slice of the input; its partial products are summed over the ranks by one all-reduce.
The weights come already sliced (kiln.models.sharding.ShardedWeightStore); `tp_group=None` is one
process and no all-reduce.
"""

from __future__ import annotations

import torch

from kiln.models.layers.linear import Linear
from kiln.models.layers.tp import TPGroup, all_reduce
from kiln.models.weights import Weight


class RowParallelLinear(Linear):
    """y [M, out] = all_reduce(x_r [M, in_r] @ W_r^T) (+ bias, added once), x_r this rank's input slice.

    weight: this rank's columns W_r [out, in_r]; bias [out] or None (kept on rank 0 only: every rank
    would otherwise add it before the sum). Other arguments as Linear's.
    """

    def __init__(
        self,
        weight: Weight,
        bias: torch.Tensor | None,
        *,
        device: torch.device,
        dtype: torch.dtype,
        cpu_format: str | None = None,
        tp_group: TPGroup | None = None,
    ):
        if tp_group is not None and tp_group.rank != 0:
            bias = None
        super().__init__(weight, bias, device=device, dtype=dtype, cpu_format=cpu_format)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return all_reduce(super().forward(x, out_dtype), self.tp_group)

    def extra_repr(self) -> str:
        group = self.tp_group
        return super().extra_repr() + ("" if group is None else f", rank={group.rank}/{group.world_size}")
