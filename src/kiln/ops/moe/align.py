"""Token alignment for fused_moe's grouped GEMMs: sort the token-expert pairs by expert and pad each
expert's group to a multiple of the GEMM's BLOCK_M, so that every M-block belongs to one expert.

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
    A pair whose expert id is outside [0, num_experts) (ids are unchecked inside
    `kiln.ops.trusted_inputs()`) is in no group: no block is given an expert that does not exist.

Two implementations of the same contract:
  - `moe_align_block_size`: torch ops on the ids' device (a scatter-add histogram, cumsums, one
    stable argsort and a searchsorted; no `.item()`), any size;
  - `moe_align_block_size_triton`: one Triton launch for small batches (decode), where the ~10 small
    kernels of the first are a visible share of a weight-streaming MoE layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty

# One program holds a [pairs, experts] one-hot tile: 16384 elements over 8 warps compiles for sm_90
# without register spills (tests/ops/moe/test_moe_compile.py checks).
SMALL_BATCH_LIMIT = 16384


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
    # Out-of-range ids form one extra bucket, sorted after every expert and sent to a slot past the end.
    in_range = (experts >= 0) & (experts < num_experts)
    experts = torch.where(in_range, experts, num_experts)

    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    counts = counts[:num_experts]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, 0)
    padded_start = padded_end - padded_counts
    group_start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(experts, stable=True)  # pair ids, grouped by expert, ascending inside a group
    sorted_experts = experts[order]
    expert = sorted_experts.clamp(max=num_experts - 1)  # a valid index; the extra bucket's is unused
    rank = torch.arange(num_pairs, device=device) - group_start[expert]
    destination = torch.where(sorted_experts < num_experts, padded_start[expert] + rank, max_padded)

    # One slot more than returned: the out-of-range pairs' scatter target.
    sorted_pair_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, destination, order.to(torch.int32))
    sorted_pair_ids = sorted_pair_ids[:max_padded]

    # Block b starts at b * block_m; its expert is the first whose padded group ends after that.
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    num_padded = padded_end[-1:]
    block_expert_ids = torch.where(block_starts < num_padded, block_expert_ids, -1).to(torch.int32)
    return sorted_pair_ids, block_expert_ids, num_padded.to(torch.int32)


# ---- one Triton program, pairs x experts one-hot matrix in registers:
#   counts[e]      = sum_p onehot[p, e]
#   padded_start   = exclusive cumsum of counts rounded up to BLOCK_M
#   rank[p]        = number of earlier pairs with the same expert (exclusive cumsum of onehot down p)
#   sorted[padded_start[e_p] + rank[p]] = p, every other slot the sentinel num_pairs
#   block_expert[b] = number of experts whose padded group ends at or before b * BLOCK_M (-1 past the end)


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    num_experts,
    max_padded,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pairs = tl.arange(0, BLOCK_P)
    experts = tl.arange(0, BLOCK_E)
    pair_mask = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=pair_mask, other=-1)
    # Compared before narrowing to int32, so a huge int64 id cannot wrap into range. A pair kept out
    # matches no column and is not stored (its destination would be slot 0, another pair's).
    kept = pair_mask & (ids >= 0) & (ids < num_experts)
    expert_of = tl.where(kept, ids, -1).to(tl.int32)
    onehot = (expert_of[:, None] == experts[None, :]).to(tl.int32)

    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    destination = tl.sum(onehot * padded_start[None, :], axis=1) + rank

    # Sentinel everywhere first; the barrier orders those stores before the scatter below.
    for start in range(0, max_padded, BLOCK_S):
        slots = start + tl.arange(0, BLOCK_S)
        tl.store(sorted_ptr + slots, tl.full((BLOCK_S,), 0, tl.int32) + num_pairs, mask=slots < max_padded)
    tl.debug_barrier()
    tl.store(sorted_ptr + destination, pairs, mask=kept)

    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    expert_valid = experts < num_experts
    for start in range(0, num_blocks, BLOCK_S):
        blocks = start + tl.arange(0, BLOCK_S)
        block_start = blocks * BLOCK_M
        done = (padded_end[None, :] <= block_start[:, None]) & expert_valid[None, :]
        expert = tl.sum(done.to(tl.int32), axis=1)
        expert = tl.where(block_start < total, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < num_blocks)


def fits_single_program(num_pairs: int, num_experts: int) -> bool:
    return (
        triton.next_power_of_2(max(num_pairs, 1)) * triton.next_power_of_2(num_experts) <= SMALL_BATCH_LIMIT
    )


def align_block_s(block_e: int) -> int:
    """Slots per step of the kernel's fill and block-expert loops: the [BLOCK_S, BLOCK_E] comparison
    stays at <= 8192 elements (BLOCK_S 256 with 256 experts spilled registers on sm_90 in triton 3.6)."""
    return min(256, 8192 // block_e)


def moe_align_block_size_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `moe_align_block_size`, in one launch (small batches only:
    `fits_single_program(num_pairs, num_experts)` must hold)."""
    num_pairs = topk_ids.numel()
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    num_blocks = max_padded // block_m
    device = topk_ids.device
    sorted_pair_ids = empty((max_padded,), torch.int32, device)
    block_expert_ids = empty((num_blocks,), torch.int32, device)
    num_padded = empty((1,), torch.int32, device)
    _moe_align_kernel[(1,)](
        topk_ids.contiguous(),
        sorted_pair_ids,
        block_expert_ids,
        num_padded,
        num_pairs,
        num_experts,
        max_padded,
        num_blocks,
        BLOCK_M=block_m,
        BLOCK_P=triton.next_power_of_2(max(num_pairs, 1)),
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_S=align_block_s(triton.next_power_of_2(num_experts)),
        num_warps=8,
    )
    return sorted_pair_ids, block_expert_ids, num_padded
