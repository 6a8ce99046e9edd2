"""Fast CPU fused_moe (what the engine runs without a GPU).

One stable sort groups the token-expert pairs by expert; then one gather, two matmuls and one
index_add per *active* expert. Matmuls in x's dtype; SiLU-mul, scales and the top-k sum in float32.
FP8 experts are converted one at a time, only when hit. A pair whose expert id is out of range
(unchecked inside `trusted_inputs()`) adds nothing, as in the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.moe.fused_moe.spec import FUSED_MOE
from kiln.ops.registry import Implementation, cpu_only


def fused_moe_cpu(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None):
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w_gate_up.shape[0], w_down.shape[2]
    out = torch.zeros((num_tokens, w_down.shape[1]), dtype=torch.float32, device=x.device)
    experts = topk_ids.reshape(-1).to(torch.int64)
    # Out-of-range ids sort into one last bucket, past every expert, which the loop never reaches.
    experts = torch.where((experts >= 0) & (experts < num_experts), experts, num_experts)
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts + 1)[:num_experts].tolist()
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


FUSED_MOE.register(Implementation("cpu", fused_moe_cpu, cpu_only))
