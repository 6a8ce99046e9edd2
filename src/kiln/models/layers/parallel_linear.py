"""Tensor-parallel linear layers and the weight slicing they need.

Megatron-style pairs, W in the checkpoint's [out_features, in_features] layout:
  - column-parallel: rank r keeps rows [n0, n1) of W (its slice of the outputs); no communication,
    the output stays sharded (fused QKV by whole heads, gate/up by intermediate columns);
  - row-parallel:    rank r keeps columns [k0, k1) of W and consumes the matching slice of the input;
    its partial products are summed over the ranks with one all-reduce (attention o_proj, MLP
    down_proj).

Quantized weights shard together with their scales: GGUF blocks cover 32 consecutive inputs of one
output row, so a row slice is free and a column slice must start and end on a 32-element boundary;
int4_linear weights likewise on group boundaries (shard_int4); fp8 weights keep their per-channel
(row slice) or per-tensor scales (shard_fp8). The loaders hand out GGUF blocks or float tensors today,
so TP uses shard_rows / shard_cols; the int4 / fp8 helpers are for checkpoints stored in those formats.
"""

from __future__ import annotations

import torch

from kiln.distributed.collectives import all_reduce
from kiln.distributed.groups import TPGroup
from kiln.models.layers.linear import Linear
from kiln.models.weights import GGUF_BLOCK_BYTES, GGUF_BLOCK_SIZE, GGUFWeight, Weight


def shard_rows(weight: Weight, start: int, end: int) -> Weight:
    """Rows [start, end) of a matrix [out, in] (GGUF blocks included) or elements of a vector [out]."""
    if isinstance(weight, GGUFWeight):
        data = weight.data[start:end].contiguous()
        return GGUFWeight(weight.qtype, data, (end - start, weight.shape[1]))
    return weight[start:end].contiguous()


def shard_cols(weight: Weight, start: int, end: int, what: str = "weight") -> Weight:
    """Columns [start, end) of a matrix [out, in]. GGUF blocks: start and end must be multiples of 32
    (a block's scale covers 32 inputs), else ValueError."""
    if not isinstance(weight, GGUFWeight):
        return weight[:, start:end].contiguous()
    if start % GGUF_BLOCK_SIZE or end % GGUF_BLOCK_SIZE:
        raise ValueError(
            f"tensor parallel: cannot shard {what} ({weight.qtype}) along its inputs at [{start}, {end}): "
            f"GGUF blocks hold {GGUF_BLOCK_SIZE} inputs, so shard boundaries must be multiples of "
            f"{GGUF_BLOCK_SIZE}; use a tp size that divides the heads / intermediate size accordingly"
        )
    n, k = weight.shape
    block_bytes = GGUF_BLOCK_BYTES[weight.qtype]
    blocks = weight.data.view(n, k // GGUF_BLOCK_SIZE, block_bytes)
    data = blocks[:, start // GGUF_BLOCK_SIZE : end // GGUF_BLOCK_SIZE].reshape(n, -1).contiguous()
    return GGUFWeight(weight.qtype, data, (n, end - start))


class RowParallelLinear(torch.nn.Module):
    """y [M, out] = all_reduce(x_r [M, in_r] @ W_r^T) (+ bias, added once), x_r this rank's input slice.

    local: the Linear over this rank's columns W_r [out, in_r]; its output dtype is x's.
    """

    def __init__(self, local: Linear, group: TPGroup):
        super().__init__()
        self.local = local
        self.group = group
        # every rank would add the bias before the sum: keep it on rank 0 only
        if group.rank != 0:
            local.bias = None

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Same arguments as the wrapped Linear's forward (e.g. out_dtype)."""
        return all_reduce(self.local(x, *args, **kwargs), self.group)

    def __getattr__(self, name: str):
        # the model reads Linear attributes (in_features, compute_dtype, ...) through the wrapper
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "local":
                raise
            return getattr(self.local, name)

    def extra_repr(self) -> str:
        return f"rank={self.group.rank}/{self.group.world_size}"


def shard_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    in_features: int,
    axis: int,
    start: int,
    end: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slice of an int4_linear weight (qweight int32 [N, ceil(K/8)] packed along K, scales / zeros
    [N, G]) with its group scales and zero points. axis 0: output rows [start, end); axis 1: inputs
    [start, end), which must lie on group boundaries (end may be K, where the last group is short)."""
    if axis == 0:
        return qweight[start:end].contiguous(), scales[start:end].contiguous(), zeros[start:end].contiguous()
    if start % group_size or (end % group_size and end != in_features):
        raise ValueError(
            f"tensor parallel: cannot shard an int4 weight along its inputs at [{start}, {end}): boundaries "
            f"must be multiples of its group_size {group_size} (or K={in_features})"
        )
    g0, g1 = start // group_size, -(-end // group_size)
    words = qweight[:, start // 8 : -(-end // 8)].contiguous()  # group_size is a multiple of 8
    return words, scales[:, g0:g1].contiguous(), zeros[:, g0:g1].contiguous()


def shard_fp8(
    weight: torch.Tensor, scale: torch.Tensor, axis: int, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice of an fp8_linear weight (e4m3 [N, K]) with its scale (per output channel [N, 1], or one
    per tensor [1]): output rows take their channels' scales; an input slice keeps them all."""
    if axis == 0:
        per_channel = scale.numel() > 1
        return weight[start:end].contiguous(), scale[start:end].contiguous() if per_channel else scale
    return weight[:, start:end].contiguous(), scale
