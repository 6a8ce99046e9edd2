import dataclasses
import random

import pytest
import torch

import kiln.ops
from kiln.ops.moe.moe_route import MOE_ROUTE
from kiln.ops.moe.moe_route.spec import moe_route_reference
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
