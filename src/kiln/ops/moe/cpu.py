"""Fast CPU paths for the MoE family (what the engine runs without a GPU).

fused_moe: one stable sort groups the token-expert pairs by expert; then one gather, two matmuls
and one index_add per *active* expert. Matmuls in x's dtype; SiLU-mul, scales and the top-k sum in
float32. FP8 experts are converted one at a time, only when hit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.moe.route_spec import MOE_ROUTE
from kiln.ops.moe.spec import FUSED_MOE
from kiln.ops.registry import Implementation


def _cpu_only(device):
    return device is None or device.type == "cpu"


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


def fused_moe_cpu(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None):
    num_tokens, top_k = topk_ids.shape
    inter = w_down.shape[2]
    out = torch.zeros((num_tokens, w_down.shape[1]), dtype=torch.float32, device=x.device)
    experts = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=w_gate_up.shape[0]).tolist()
    tokens_sorted = order // top_k
    weights_sorted = topk_weights.reshape(-1)[order].to(torch.float32)
    # e4m3 values are exact in fp16/bf16/fp32, so FP8 experts convert losslessly and their scale is
    # applied to the float32 results instead of being rounded into the weights.
    gate_up_scale = w_gate_up_scale.float().tolist() if w_gate_up_scale is not None else None
    down_scale = w_down_scale.float().tolist() if w_down_scale is not None else None
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        token = tokens_sorted[start : start + count]
        gate_up = (x[token] @ w_gate_up[expert].to(x.dtype).T).float()
        if gate_up_scale is not None:
            gate_up *= gate_up_scale[expert]
        hidden = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        route = weights_sorted[start : start + count, None]
        if down_scale is not None:
            route = route * down_scale[expert]
        out.index_add_(0, token, (hidden @ w_down[expert].to(x.dtype).T).float() * route)
        start += count
    return out.to(x.dtype)


MOE_ROUTE.register(Implementation("cpu", moe_route_cpu, _cpu_only))
FUSED_MOE.register(Implementation("cpu", fused_moe_cpu, _cpu_only))
