"""Expert parallelism: each rank holds whole routed experts and the tokens travel to them.

The ranks of the tensor-parallel group (attention, dense layers and vocabulary split as usual) hold
num_experts / N whole experts each, experts [r * E/N, (r + 1) * E/N) on rank r. A MoE layer's input
x [T, hidden] is the same on every rank (it follows an all-reduce), so the layer works on token slices:

  1. rank r routes its own slice of the tokens, rows [t0, t1) of split_evenly(T, N) (router replicated);
  2. it orders its (token, expert) pairs by the rank holding the expert and exchanges the counts
     with all_to_all_single on an int64 [N] tensor: every rank then knows how many rows it receives;
  3. the pairs' rows of x, and their (local expert id, routing weight), go to the expert ranks with
     all_to_all_single, into buffers sized from the exchanged counts (no capacity limit, no token
     dropped; a rank may receive zero rows);
  4. each rank runs its local experts on what it received (kiln.ops.fused_moe, one pair a row, the
     routing weight applied there) and a second all_to_all_single sends the rows back;
  5. the sender sums each token's top-k rows (float32) and the slices are all-gathered to [T, hidden].

Communication per MoE layer: 4 all-to-alls (counts, metadata, rows out, rows back) and one all-gather,
all on `ExpertParallelGroup.expert_group`. This module talks to torch.distributed directly (as
kiln.models.layers.tp does); kiln.distributed.groups creates the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.models.layers.tp import TPGroup

# (rows [R, hidden], local expert ids int64 [R, 1], routing weights float32 [R, 1]) -> [R, hidden]
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ExpertParallelGroup(TPGroup):
    """A TPGroup whose MoE layers hold whole experts (expert parallelism over the same ranks).

    expert_group: the process group of the token all-to-alls and the all-gather (NCCL on GPUs, gloo on
    CPUs; same ranks and timeout as device_group).
    """

    expert_group: object = None


def expert_parallel_size(group: TPGroup | None) -> int:
    """How many ranks share the routed experts whole (1: none, or tensor-parallel experts)."""
    return group.world_size if isinstance(group, ExpertParallelGroup) else 1


def token_slice(num_tokens: int, ranks: int, rank: int) -> tuple[int, int]:
    """[t0, t1): rank `rank`'s rows of a [num_tokens, ...] batch split in `ranks` near-equal slices
    (larger first; a rank gets none when num_tokens < ranks)."""
    base, extra = divmod(num_tokens, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def exchange_counts(send_counts: torch.Tensor, group: ExpertParallelGroup) -> torch.Tensor:
    """send_counts int64 [N] (rows this rank sends to each rank) -> int64 [N], rows it receives from each."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group.expert_group)
    return recv


def all_to_all_rows(
    rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: ExpertParallelGroup
) -> torch.Tensor:
    """rows [sum(send_counts), ...], ordered by destination rank -> [sum(recv_counts), ...], ordered by
    source rank (the variable-size all_to_all_single)."""
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group.expert_group)
    return out


def dispatch_combine(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts_per_rank: int,
    local_experts: LocalExperts,
    group: ExpertParallelGroup,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for this rank's tokens, with each expert
    run on the rank that holds it (steps 2-5 of the module doc, before the all-gather).

    x [n, hidden] (n may be 0); topk_weights float [n, k]; topk_ids int [n, k], global expert ids;
    experts_per_rank: E / N; local_experts: runs this rank's experts (see LocalExperts).
    Returns [n, hidden] in x's dtype. Every rank of the group must call it (collectives)."""
    n, top_k = topk_ids.shape
    ids = topk_ids.reshape(-1).to(torch.int64)
    dest = ids // experts_per_rank
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=group.world_size).to(torch.int64)
    recv_counts = exchange_counts(send_counts, group)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    # one float32 [pairs, 2] message for (local expert id, weight): ids < 2^24 are exact in float32
    meta = torch.stack(
        [(ids - dest * experts_per_rank)[order].to(torch.float32), topk_weights.reshape(-1)[order].float()], 1
    )
    recv_meta = all_to_all_rows(meta, sends, recvs, group)
    recv_x = all_to_all_rows(x[order // top_k], sends, recvs, group)
    if recv_x.shape[0]:
        local_ids = recv_meta[:, :1].to(torch.int64)
        expert_out = local_experts(recv_x, local_ids, recv_meta[:, 1:].contiguous())
    else:
        expert_out = recv_x  # [0, hidden]: nothing to run, still joins the return all-to-all
    back = all_to_all_rows(expert_out, recvs, sends, group)
    pairs = torch.empty((n * top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    pairs[order] = back.float()
    return pairs.view(n, top_k, x.shape[1]).sum(dim=1).to(x.dtype)


def gather_token_slices(part: torch.Tensor, num_tokens: int, group: ExpertParallelGroup) -> torch.Tensor:
    """Every rank's token slice part [t1 - t0, hidden] (token_slice's split of num_tokens) -> the whole
    [num_tokens, hidden] on every rank (all_gather of slices padded to the largest)."""
    ranks = group.world_size
    width = token_slice(num_tokens, ranks, 0)[1]
    padded = part
    if part.shape[0] != width:
        padded = torch.cat([part, part.new_zeros((width - part.shape[0], *part.shape[1:]))])
    slices = [torch.empty_like(padded) for _ in range(ranks)]
    dist.all_gather(slices, padded.contiguous(), group=group.expert_group)
    sizes = [b - a for a, b in (token_slice(num_tokens, ranks, r) for r in range(ranks))]
    return torch.cat([s[:size] for s, size in zip(slices, sizes, strict=True)])
