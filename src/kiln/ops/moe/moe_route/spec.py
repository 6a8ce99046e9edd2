"""MoE routing: gate scores, top-k experts per token, optional renormalization.

moe_route(router_logits, top_k, renormalize=True, scoring="softmax")
    router_logits: [num_tokens, num_experts]  float32 / float16 / bfloat16
    scoring "softmax": p = softmax(logits) over all experts (Mixtral, Qwen2-MoE);
            "sigmoid": p = sigmoid(logits) per expert.
    topk_ids     int32   [num_tokens, top_k]: the top_k experts by score, highest first
    topk_weights float32 [num_tokens, top_k]: their p, divided by their sum when `renormalize`.
    Experts are chosen by logit (same order as p, since both scorings are monotonic), so the choice
    never depends on how p was rounded. Math in float32.
Returns `(topk_weights, topk_ids)`; fused_moe takes them as they are.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size

OP = "moe_route"
SCORINGS = ("softmax", "sigmoid")


def moe_route_reference(router_logits, top_k, renormalize=True, scoring="softmax"):
    logits = router_logits.to(torch.float64 if router_logits.dtype == torch.float64 else torch.float32)
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    _, ids = torch.topk(logits, top_k, dim=-1, sorted=True)
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def validate_moe_route(router_logits, top_k, renormalize, scoring) -> None:
    check_tensor(OP, "router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    num_experts = router_logits.shape[1]
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{OP}: top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"{OP}: scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")


def distinct_logits(num_tokens, num_experts, dtype, device, generator, spread=0.5):
    """Router logits whose ranking is unambiguous in any dtype: a random permutation of
    0, spread, 2*spread, ... per token plus noise smaller than the gap, so no two experts tie after
    rounding to bf16 (a tie would make the top-k ids, and hence the test, arbitrary)."""
    ranks = torch.argsort(torch.rand((num_tokens, num_experts), generator=generator), dim=-1).float()
    noise = torch.rand((num_tokens, num_experts), generator=generator) * 0.2 * spread
    logits = (ranks - num_experts / 2) * spread + noise
    return logits.to(dtype=dtype, device=device)


def _make_inputs(shape, dtype, device, generator):
    return {
        "router_logits": distinct_logits(shape["tokens"], shape["experts"], dtype, device, generator),
        "top_k": shape["top_k"],
        "renormalize": shape.get("renormalize", True),
        "scoring": shape.get("scoring", "softmax"),
    }


def _fuzz_shapes(rng):
    shapes = [
        {"tokens": 1, "experts": 8, "top_k": 2},
        {"tokens": 37, "experts": 8, "top_k": 2},
        {"tokens": 5, "experts": 60, "top_k": 4, "renormalize": False},  # Qwen1.5-MoE-A2.7B
        {"tokens": 9, "experts": 3, "top_k": 3},  # every expert chosen
        {"tokens": 13, "experts": 7, "top_k": 1, "scoring": "sigmoid"},
        {"tokens": 6, "experts": 256, "top_k": 8, "scoring": "sigmoid"},  # DeepSeek-V3 sized
    ]
    for _ in range(2):
        experts = rng.randint(2, 70)
        shapes.append(
            {
                "tokens": rng.randint(1, 80),
                "experts": experts,
                "top_k": rng.randint(1, min(experts, 8)),
                "renormalize": rng.random() < 0.5,
                "scoring": rng.choice(SCORINGS),
            }
        )
    return shapes


def _bytes(shape, dtype):
    tokens, experts, top_k = shape["tokens"], shape["experts"], shape["top_k"]
    return (
        tokens * experts * element_size(dtype) + tokens * top_k * 8
    )  # logits in; fp32 weights + int32 ids out


def _torch_eager(router_logits, top_k, renormalize=True, scoring="softmax"):
    scores = (
        torch.softmax(router_logits.float(), -1)
        if scoring == "softmax"
        else torch.sigmoid(router_logits.float())
    )
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.int()


def _fake(router_logits, top_k, renormalize, scoring):
    shape = (router_logits.shape[0], top_k)
    weights = router_logits.new_empty(shape, dtype=torch.float32)
    return weights, router_logits.new_empty(shape, dtype=torch.int32)


MOE_ROUTE = OpSpec(
    name=OP,
    description="MoE gating: softmax/sigmoid scores, top-k experts, optional renormalization",
    reference=moe_route_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # The logits are exact in every dtype and the math is float32 for all of them, so the only
    # error is a few float32 roundings (exp, sum, divide): ~1e-7 relative. A wrong expert id
    # shifts the ids' norm by far more than 1e-5, so one tolerance serves weights and ids.
    tolerance={torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5},
    flops=lambda s, dtype: s["tokens"] * s["experts"] * (4 + s["top_k"]),
    bytes=_bytes,
    bench_shapes={
        "llm": [
            {"tokens": t, "experts": e, "top_k": k}
            for t in (1, 64, 4096)
            for e, k in ((8, 2), (60, 4), (256, 8))  # Mixtral, Qwen1.5-MoE, DeepSeek-V3 sized
        ]
    },
    baselines={"torch_eager": _torch_eager},
    schema=(
        '(Tensor router_logits, int top_k, bool renormalize=True, str scoring="softmax") '
        "-> (Tensor, Tensor)"
    ),
    validate=validate_moe_route,
    fake=_fake,
    call_case=lambda router_logits, top_k, renormalize, scoring: (
        {"tokens": router_logits.shape[0], "experts": router_logits.shape[1], "top_k": top_k},
        router_logits.dtype,
    ),
    doc=__doc__,
)

moe_route = define_op(MOE_ROUTE, "kiln.ops")
