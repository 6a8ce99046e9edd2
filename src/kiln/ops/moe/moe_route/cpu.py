"""Fast CPU routing: PyTorch's top-k on the float32 logits, then the scores of the chosen experts."""

from __future__ import annotations

import torch

from kiln.ops.moe.moe_route.spec import MOE_ROUTE
from kiln.ops.registry import Implementation, cpu_only


def moe_route_cpu(router_logits, top_k, renormalize=True, scoring="softmax"):
    logits = router_logits.float()
    _, ids = torch.topk(logits, top_k, dim=-1)
    if scoring == "softmax":
        weights = torch.softmax(logits, dim=-1).gather(-1, ids)
    else:
        weights = torch.sigmoid(logits.gather(-1, ids))
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


MOE_ROUTE.register(Implementation("cpu", moe_route_cpu, cpu_only))
