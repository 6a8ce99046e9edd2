"""Token alignment for the grouped MoE GEMM: sort token-expert pairs by expert and pad each expert's
group to a multiple of the GEMM's BLOCK_M, so that every M-block of the GEMM belongs to one expert.

moe_align_block_size(topk_ids, num_experts, block_m)
    topk_ids: int32/int64 [num_tokens, top_k]; pair p = t * top_k + j is token t's j-th choice.
    Returns
      sorted_pair_ids      int32 [max_padded]: pair ids grouped by expert (ascending within an expert),
                           each group padded up to a multiple of block_m with the sentinel num_pairs;
                           slots past the last group also hold the sentinel.
      block_expert_ids     int32 [max_padded // block_m]: the expert of each M-block, -1 past the end.
      num_padded           int32 [1]: total padded length (sum of the groups), on the device.
    max_padded = roundup(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) is the
    static worst case, so the GEMM grid never depends on device data (no host sync, graph capturable).

All torch ops on the tensors' device: a scatter-add histogram, cumsums, one stable argsort and a
searchsorted; no `.item()`.
"""

from __future__ import annotations

import torch


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the padded length: every non-empty expert wastes < block_m slots."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the `[num_tokens, top_k]` token-expert pairs by expert, padded to `block_m` (see module doc)."""
    if block_m < 1:
        raise ValueError(f"moe_align_block_size: block_m must be >= 1, got {block_m}")
    device = topk_ids.device
    experts = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = experts.numel()
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)

    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, 0)
    padded_start = padded_end - padded_counts
    group_start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(experts, stable=True)  # pair ids, grouped by expert, ascending inside a group
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=device) - group_start[sorted_experts]
    destination = padded_start[sorted_experts] + rank

    sorted_pair_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, destination, order.to(torch.int32))

    # Block b starts at b * block_m; its expert is the first whose padded group ends after that.
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    num_padded = padded_end[-1:]
    block_expert_ids = torch.where(block_starts < num_padded, block_expert_ids, -1).to(torch.int32)
    return sorted_pair_ids, block_expert_ids, num_padded.to(torch.int32)
