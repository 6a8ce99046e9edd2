"""moe_align_block_size (torch ops) and its one-launch Triton twin: the layout fused_moe's grouped
GEMMs read (kiln/ops/moe/align.py)."""

import random

import pytest
import torch

from kiln.ops.alloc import poisoned
from kiln.ops.moe.align import max_padded_pairs, moe_align_block_size, moe_align_block_size_triton

ALIGNS = pytest.mark.parametrize(
    "align", [moe_align_block_size, moe_align_block_size_triton], ids=["torch", "triton"]
)


def _expected_alignment(topk_ids, num_experts, block_m):
    """Plain-Python alignment: pairs grouped by expert in ascending order, padded per expert."""
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    sorted_ids, block_experts = [], []
    for expert in range(num_experts):
        group = [p for p, e in enumerate(flat) if e == expert]
        if not group:
            continue
        padded = -(-len(group) // block_m) * block_m
        sorted_ids += group + [sentinel] * (padded - len(group))
        block_experts += [expert] * (padded // block_m)
    return sorted_ids, block_experts


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, block_m",
    [
        (1, 2, 8, 16),
        (37, 2, 8, 16),
        (50, 1, 4, 32),
        (9, 4, 64, 16),
        (13, 3, 5, 1),
        (0, 2, 4, 16),
        (300, 2, 8, 64),
    ],
)
@ALIGNS
def test_moe_align_groups_pairs_by_expert_with_padding(
    align, num_tokens, top_k, num_experts, block_m, device
):
    generator = torch.Generator().manual_seed(random.randrange(2**31))
    # Skewed choice (some experts get most tokens, some none): distinct experts per token via argsort.
    scores = torch.rand(num_tokens, num_experts, generator=generator) + torch.linspace(1, 0, num_experts)
    topk_ids = torch.argsort(scores, dim=-1, descending=True)[:, :top_k].to(torch.int32)
    _check_alignment(align, topk_ids, num_experts, block_m, device)


@ALIGNS
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_moe_align_leaves_pairs_with_out_of_range_experts_out_of_every_group(align, ids_dtype, device):
    # 5 experts (the Triton kernel's one-hot has 8 columns): ids -1, 5 and 7 fall inside or before
    # that tile, 8 and 2**31 - 1 past it; 2**32 + 1 would wrap to expert 1 if narrowed to int32.
    bad = [-1, 5, 7, 8, 2**31 - 1] + ([2**32 + 1] if ids_dtype == torch.int64 else [])
    rows = [[0, 2], [bad[0], 1], [3, bad[1]], [bad[2], 0], [4, bad[3]], [bad[4], 2]]
    rows += [[1, b] for b in bad[5:]] + [[2, 0], [1, 4]]
    topk_ids = torch.tensor(rows, dtype=ids_dtype)
    _check_alignment(align, topk_ids, 5, 2, device)


def _check_alignment(align, topk_ids, num_experts, block_m, device):
    num_pairs = topk_ids.numel()
    with poisoned():  # slots the kernel forgets to write show up as int32 min
        sorted_ids, block_experts, num_padded = align(topk_ids.to(device), num_experts, block_m)
    sorted_ids, block_experts, num_padded = sorted_ids.cpu(), block_experts.cpu(), num_padded.cpu()

    expected_ids, expected_blocks = _expected_alignment(topk_ids, num_experts, block_m)
    max_padded = max_padded_pairs(num_pairs, num_experts, block_m)
    assert sorted_ids.dtype == torch.int32 and block_experts.dtype == torch.int32
    assert sorted_ids.shape == (max_padded,) and block_experts.shape == (max_padded // block_m,)
    assert int(num_padded) == len(expected_ids)
    assert sorted_ids[: len(expected_ids)].tolist() == expected_ids
    assert (sorted_ids[len(expected_ids) :] == num_pairs).all()
    assert block_experts[: len(expected_blocks)].tolist() == expected_blocks
    assert (block_experts[len(expected_blocks) :] == -1).all()
