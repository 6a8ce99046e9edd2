"""The MoE family as `torch.library` custom ops, `torch.ops.kiln.<name>` (see kiln/ops/library.py for
why): each wraps the public function (validation + dispatch) and has a fake that validates and
allocates the outputs, so `torch.compile(fullgraph=True)` and CUDA graphs take the kernels as they are.

    moe_route(router_logits, top_k, renormalize=True, scoring="softmax") -> (weights f32, ids i32)
    fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None)
"""

from __future__ import annotations

import torch

from kiln.ops.moe.route_spec import moe_route, validate_moe_route
from kiln.ops.moe.spec import fused_moe, validate_fused_moe

REGISTERED = ("moe_route", "fused_moe")


@torch.library.custom_op("kiln::moe_route", mutates_args=())
def _moe_route_op(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_route(router_logits, top_k, renormalize, scoring)


@_moe_route_op.register_fake
def _(router_logits, top_k, renormalize=True, scoring="softmax"):
    validate_moe_route(router_logits, top_k, renormalize, scoring)
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(
        shape, dtype=torch.int32
    )


@torch.library.custom_op("kiln::fused_moe", mutates_args=())
def _fused_moe_op(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up_scale: torch.Tensor | None = None,
    w_down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale)


@_fused_moe_op.register_fake
def _(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None):
    validate_fused_moe(
        x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, check_ids=False
    )
    return torch.empty_like(x)
