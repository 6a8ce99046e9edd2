"""Single-launch Triton version of `moe_align_block_size` for small batches (decode).

The torch-ops version (align.py) is ~10 small kernels; at decode that launch overhead is a visible
share of a weight-streaming MoE layer, so up to SMALL_BATCH_LIMIT one program does it all with the
pairs x experts one-hot matrix held in registers:
  counts[e]      = sum_p onehot[p, e]
  padded_start   = exclusive cumsum of counts rounded up to BLOCK_M
  rank[p]        = number of earlier pairs with the same expert (exclusive cumsum of onehot down p)
  sorted[padded_start[e_p] + rank[p]] = p, every other slot the sentinel num_pairs
  block_expert[b] = number of experts whose padded group ends at or before b * BLOCK_M (-1 past the end)
Output layout and values are identical to align.py's (see its docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.moe.align import max_padded_pairs

# One program holds a [pairs, experts] one-hot tile: 16384 elements over 8 warps compiles for sm_90
# without register spills (tests/ops/test_moe_compile.py checks).
SMALL_BATCH_LIMIT = 16384


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
    expert_of = tl.load(topk_ids_ptr + pairs, mask=pair_mask, other=-1).to(tl.int32)
    onehot = (expert_of[:, None] == experts[None, :]).to(tl.int32)  # padding pairs match nothing

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
    tl.store(sorted_ptr + destination, pairs, mask=pair_mask)

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
    """Same contract as `kiln.ops.moe.align.moe_align_block_size`, in one launch (small batches only:
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
