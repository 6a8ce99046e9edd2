"""Triton kernel for qk_norm_rope: per-head RMSNorm then rotary embedding, in place on q and k.

Grid (tokens, q head blocks + k head blocks): a program owns one token and BLOCK_H heads of either
q or k. It loads the [BLOCK_H, BLOCK_D] tile of whole heads and reduces each head's sum of squares in
float32 (the norm needs all D dims before any dim can be written); then it loads the pair halves x1
and x2 of the rotary dims (NeoX: columns i and i + r; GPT-J: 2i and 2i + 1; a second read of bytes
the tile just brought into cache), normalizes and rotates them, and stores them, plus the normalized
dims past rotary_dim, over the input. All loads come before the first store.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.checks import check_block_config
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.rope.cache import rope_tuning_shape
from kiln.ops.rope.qk_norm_rope.spec import QK_NORM_ROPE
from kiln.ops.tuned_configs import lookup

MAX_BLOCK_ELEMENTS = 4096  # head elements per program: caps registers for wide heads


@triton.jit
def _norm_rotate_heads(
    base,
    head_stride,
    n_heads,
    first_head,
    weight_ptr,
    cos,
    sin,
    pair,
    pair_mask,
    half_rotary,
    head_dim,
    eps,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Normalize and rotate heads [first_head, first_head + BLOCK_H) of one token, in place."""
    heads = first_head + tl.arange(0, BLOCK_H)
    head_mask = heads < n_heads
    rows = base + heads.to(tl.int64)[:, None] * head_stride
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < head_dim
    x = tl.load(rows + cols[None, :], mask=head_mask[:, None] & col_mask[None, :], other=0.0)
    x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / head_dim + eps)  # [BLOCK_H]
    if IS_NEOX:
        first, second = pair, pair + half_rotary
    else:
        first, second = 2 * pair, 2 * pair + 1
    pair_tile = head_mask[:, None] & pair_mask[None, :]
    x1 = tl.load(rows + first[None, :], mask=pair_tile, other=0.0).to(tl.float32)
    x2 = tl.load(rows + second[None, :], mask=pair_tile, other=0.0).to(tl.float32)
    w1 = tl.load(weight_ptr + first, mask=pair_mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + second, mask=pair_mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y1 = x1 * inv_rms[:, None] * w1[None, :]
    y2 = x2 * inv_rms[:, None] * w2[None, :]
    out1 = y1 * cos[None, :] - y2 * sin[None, :]
    out2 = y2 * cos[None, :] + y1 * sin[None, :]
    past_rotary = head_mask[:, None] & (col_mask & (cols >= 2 * half_rotary))[None, :]
    y = x * inv_rms[:, None] * w[None, :]
    tl.store(rows + cols[None, :], y.to(base.dtype.element_ty), mask=past_rotary)
    tl.store(rows + first[None, :], out1.to(base.dtype.element_ty), mask=pair_tile)
    tl.store(rows + second[None, :], out2.to(base.dtype.element_ty), mask=pair_tile)


@triton.jit
def _qk_norm_rope_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cache_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cache_stride,
    n_q_heads,
    n_k_heads,
    half_rotary,
    head_dim,
    eps,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    pair = tl.arange(0, BLOCK_R)
    pair_mask = pair < half_rotary
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cache_ptr + position * cache_stride + pair, mask=pair_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + position * cache_stride + half_rotary + pair, mask=pair_mask, other=0.0)
    sin = sin.to(tl.float32)
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    # One call per branch, nothing merged after the if: the q and k arguments may be specialized
    # differently (an int argument equal to 1 becomes a constexpr), which a merge would reject.
    if head_block < n_q_blocks:
        _norm_rotate_heads(
            q_ptr + token * q_token_stride, q_head_stride, n_q_heads, head_block * BLOCK_H, q_weight_ptr,
            cos, sin, pair, pair_mask, half_rotary, head_dim, eps, IS_NEOX, BLOCK_H, BLOCK_D,
        )  # fmt: skip
    else:
        _norm_rotate_heads(
            k_ptr + token * k_token_stride, k_head_stride, n_k_heads, (head_block - n_q_blocks) * BLOCK_H,
            k_weight_ptr, cos, sin, pair, pair_mask, half_rotary, head_dim, eps, IS_NEOX, BLOCK_H, BLOCK_D,
        )  # fmt: skip


def qk_norm_rope_configs(shape, dtype):
    """Tuning space: heads per program x num_warps (the head dim is always one block)."""
    block_d = triton.next_power_of_2(shape["head_dim"])
    most_heads = triton.next_power_of_2(max(shape["q_heads"], shape["kv_heads"]))
    return [
        {"BLOCK_H": block_h, "num_warps": warps}
        for block_h in (1, 2, 4, 8, 16, 32, 64)
        if block_h <= most_heads and block_h * block_d <= MAX_BLOCK_ELEMENTS
        for warps in (1, 2, 4, 8)
        if block_h * block_d >= 64 * warps or warps == 1
    ]


def _heuristic(n_q_heads: int, n_k_heads: int, block_d: int) -> dict:
    block_h = max(min(triton.next_power_of_2(max(n_q_heads, n_k_heads)), MAX_BLOCK_ELEMENTS // block_d), 1)
    return {"BLOCK_H": block_h, "num_warps": max(min(block_h * block_d // 512, 8), 1)}


def qk_norm_rope_triton(
    positions, q, k, q_weight, k_weight, cos_sin_cache, eps=1e-6, is_neox=True, config: dict | None = None
):
    tokens = positions.shape[0]
    n_q_heads, n_k_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    half_rotary = cos_sin_cache.shape[-1] // 2
    if tokens == 0:
        return q, k
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()  # read-only: a copy is harmless here
    block_d = triton.next_power_of_2(head_dim)
    if config is None:
        config = lookup("qk_norm_rope", q.dtype, rope_tuning_shape(q, k, cos_sin_cache, is_neox), q.device)
    config = check_block_config(
        "qk_norm_rope", config or _heuristic(n_q_heads, n_k_heads, block_d), ("BLOCK_H",)
    )
    block_h = config["BLOCK_H"]
    head_blocks = triton.cdiv(n_q_heads, block_h) + triton.cdiv(n_k_heads, block_h)
    _qk_norm_rope_kernel[(tokens, head_blocks)](
        positions,
        q,
        k,
        q_weight.contiguous(),
        k_weight.contiguous(),
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        n_q_heads,
        n_k_heads,
        half_rotary,
        head_dim,
        eps,
        IS_NEOX=bool(is_neox),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_R=triton.next_power_of_2(half_rotary),
        num_warps=config["num_warps"],
    )
    return q, k


QK_NORM_ROPE.register(
    Implementation("triton", qk_norm_rope_triton, triton_available, configs=qk_norm_rope_configs)
)
