import dataclasses
import random

import pytest
import torch

import kiln.ops
from kiln.ops.alloc import poisoned
from kiln.ops.moe.align import max_padded_pairs, moe_align_block_size
from kiln.ops.moe.route_spec import MOE_ROUTE, moe_route_reference
from kiln.ops.moe.triton_align import moe_align_block_size_triton
from kiln.ops.registry import Implementation
from kiln.verify import run_case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 1, "experts": 8, "top_k": 2},  # single decode token, Mixtral routing
        {"tokens": 37, "experts": 8, "top_k": 1},
        {"tokens": 19, "experts": 60, "top_k": 4, "renormalize": False},  # Qwen1.5-MoE, no renorm
        {"tokens": 5, "experts": 8, "top_k": 8},  # every expert, in score order
        {"tokens": 70, "experts": 13, "top_k": 3, "scoring": "sigmoid"},  # > one block of tokens
        {"tokens": 4, "experts": 256, "top_k": 8, "scoring": "sigmoid", "renormalize": False},
    ],
)
def test_moe_route_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(MOE_ROUTE, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


def test_moe_route_verifier_catches_a_wrong_expert_choice():
    def second_best_first(router_logits, top_k, renormalize=True, scoring="softmax"):
        weights, ids = moe_route_reference(router_logits, top_k + 1, renormalize, scoring)
        return weights[:, 1:], ids[:, 1:]  # plausible bug: off by one in the ranking

    spec = dataclasses.replace(MOE_ROUTE, implementations={})
    spec.register(Implementation("planted", second_best_first))
    shape = {"tokens": 9, "experts": 8, "top_k": 2, "renormalize": False}
    case = run_case(spec, "planted", shape, torch.float32, torch.device("cpu"), seed=3)
    assert not case.passed


def test_moe_route_public_function_renormalizes_to_one(device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")
    logits = torch.randn(11, 6, device=device)
    weights, ids = kiln.ops.moe_route(logits, 2)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    torch.testing.assert_close(weights.sum(-1), torch.ones(11, device=device))
    assert torch.equal(ids.long(), torch.topk(logits, 2).indices)


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(3, 4), 5), "top_k must be an int in \\[1, num_experts=4\\]"),
        ((torch.randn(3, 4), 0), "top_k must be an int"),
        ((torch.randn(3, 4, 2), 1), "router_logits must have 2 dims"),
        ((torch.randint(0, 4, (3, 4)), 1), "router_logits has dtype int64"),
        ((torch.randn(3, 4), 2, True, "relu"), "scoring must be one of softmax, sigmoid"),
    ],
)
def test_moe_route_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.moe_route(*args)


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
@pytest.mark.parametrize(
    "align", [moe_align_block_size, moe_align_block_size_triton], ids=["torch", "triton"]
)
def test_moe_align_groups_pairs_by_expert_with_padding(
    align, num_tokens, top_k, num_experts, block_m, device
):
    generator = torch.Generator().manual_seed(random.randrange(2**31))
    # Skewed choice (some experts get most tokens, some none): distinct experts per token via argsort.
    scores = torch.rand(num_tokens, num_experts, generator=generator) + torch.linspace(1, 0, num_experts)
    topk_ids = torch.argsort(scores, dim=-1, descending=True)[:, :top_k].to(torch.int32)
    with poisoned():  # slots the kernel forgets to write show up as int32 min
        sorted_ids, block_experts, num_padded = align(topk_ids.to(device), num_experts, block_m)
    sorted_ids, block_experts, num_padded = sorted_ids.cpu(), block_experts.cpu(), num_padded.cpu()

    expected_ids, expected_blocks = _expected_alignment(topk_ids, num_experts, block_m)
    max_padded = max_padded_pairs(num_tokens * top_k, num_experts, block_m)
    assert sorted_ids.dtype == torch.int32 and block_experts.dtype == torch.int32
    assert sorted_ids.shape == (max_padded,) and block_experts.shape == (max_padded // block_m,)
    assert int(num_padded) == len(expected_ids)
    assert sorted_ids[: len(expected_ids)].tolist() == expected_ids
    assert (sorted_ids[len(expected_ids) :] == num_tokens * top_k).all()
    assert block_experts[: len(expected_blocks)].tolist() == expected_blocks
    assert (block_experts[len(expected_blocks) :] == -1).all()
