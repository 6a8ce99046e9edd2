"""Triton routing kernel: scores, top-k and renormalization in one pass over the router logits.

One program owns BLOCK_T tokens and holds their whole logit rows (BLOCK_E >= num_experts) in
registers. Top-k is k rounds of row-wise argmax on the logits, each round knocking the winner out;
the winners' scores are collected into a [BLOCK_T, K_PAD] tile so the renormalization and the
stores happen once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.moe.moe_route.spec import MOE_ROUTE
from kiln.ops.registry import Implementation, triton_available


@triton.jit
def _moe_route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    logits_row_stride,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    K_PAD: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < num_tokens
    col_mask = cols < num_experts
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * logits_row_stride + cols[None, :]
    # Padding rows read 0 (finite) so their softmax stays NaN-free; padding columns are -inf so
    # they are never chosen and add nothing to the softmax denominator.
    logits = tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    logits = tl.where(col_mask[None, :], logits, float("-inf"))
    if not SIGMOID:
        row_max = tl.max(logits, axis=1)
        denom = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)

    slots = tl.arange(0, K_PAD)
    top_weights = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    remaining = logits
    for i in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        best_id = tl.argmax(remaining, axis=1)
        if SIGMOID:
            score = 1.0 / (1.0 + tl.exp(-best))
        else:
            score = tl.exp(best - row_max) / denom
        top_weights = tl.where(slots[None, :] == i, score[:, None], top_weights)
        top_ids = tl.where(slots[None, :] == i, best_id[:, None].to(tl.int32), top_ids)
        remaining = tl.where(cols[None, :] == best_id[:, None], float("-inf"), remaining)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]  # unused slots hold 0

    out_offsets = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out_offsets, top_weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, top_ids, mask=out_mask)


def moe_route_triton(router_logits, top_k, renormalize=True, scoring="softmax"):
    num_tokens, num_experts = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = empty((num_tokens, top_k), torch.float32, logits.device)
    ids = empty((num_tokens, top_k), torch.int32, logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    # At most 32 tokens a program: 64 tokens x 64 experts (Qwen2-MoE's 60) spill 560 bytes of
    # registers on sm_90 with Triton 3.6 (python -m kiln.tune.aot); 32 x 64 spill none.
    block_t = max(1, min(32, 4096 // block_e, triton.next_power_of_2(num_tokens)))
    _moe_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        weights,
        ids,
        num_tokens,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        SIGMOID=scoring == "sigmoid",
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        K_PAD=triton.next_power_of_2(top_k),
        num_warps=4 if block_t * block_e >= 2048 else 2,
    )
    return weights, ids


MOE_ROUTE.register(Implementation("triton", moe_route_triton, triton_available))
