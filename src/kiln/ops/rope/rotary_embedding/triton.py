"""Triton kernel for rotary embedding, in place on q and k.

Grid (tokens, q head blocks + k head blocks): a program owns one token and BLOCK_H heads of either
q or k. It loads the token's r = rotary_dim // 2 cos and sin values once, then a [BLOCK_H, BLOCK_R]
tile of pair halves x1 and x2 (NeoX: columns i and i + r; GPT-J: 2i and 2i + 1), rotates them in
float32 and stores them back over themselves. Columns >= rotary_dim are never touched.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.checks import check_block_config
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.rope.cache import rope_tuning_shape
from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING
from kiln.ops.tuned_configs import lookup

MAX_BLOCK_ELEMENTS = 4096  # pairs per program: caps registers for wide heads


@triton.jit
def _rotate_heads(
    base,
    head_stride,
    n_heads,
    first_head,
    cos,
    sin,
    pair,
    pair_mask,
    half_rotary,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate heads [first_head, first_head + BLOCK_H) of one token, in place; cos/sin: [BLOCK_R]."""
    heads = first_head + tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None] & pair_mask[None, :]
    if IS_NEOX:
        first, second = pair, pair + half_rotary
    else:
        first, second = 2 * pair, 2 * pair + 1
    rows = base + heads.to(tl.int64)[:, None] * head_stride
    x1 = tl.load(rows + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(rows + first[None, :], out1.to(base.dtype.element_ty), mask=mask)
    tl.store(rows + second[None, :], out2.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    cache_stride,
    n_q_heads,
    n_k_heads,
    half_rotary,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
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
        _rotate_heads(
            q_ptr + token * q_token_stride, q_head_stride, n_q_heads, head_block * BLOCK_H,
            cos, sin, pair, pair_mask, half_rotary, IS_NEOX, BLOCK_H,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr + token * k_token_stride, k_head_stride, n_k_heads, (head_block - n_q_blocks) * BLOCK_H,
            cos, sin, pair, pair_mask, half_rotary, IS_NEOX, BLOCK_H,
        )  # fmt: skip


def rotary_configs(shape, dtype):
    """Tuning space: heads per program x num_warps (the pair dim is always one block)."""
    block_r = triton.next_power_of_2(shape.get("rotary_dim", shape["head_dim"]) // 2)
    most_heads = triton.next_power_of_2(max(shape["q_heads"], shape["kv_heads"]))
    return [
        {"BLOCK_H": block_h, "num_warps": warps}
        for block_h in (1, 2, 4, 8, 16, 32, 64)
        if block_h <= most_heads and block_h * block_r <= MAX_BLOCK_ELEMENTS
        for warps in (1, 2, 4, 8)
        if block_h * block_r >= 32 * warps or warps == 1
    ]


def _heuristic(n_q_heads: int, n_k_heads: int, block_r: int) -> dict:
    block_h = max(min(triton.next_power_of_2(max(n_q_heads, n_k_heads)), MAX_BLOCK_ELEMENTS // block_r), 1)
    return {"BLOCK_H": block_h, "num_warps": max(min(block_h * block_r // 256, 8), 1)}


def rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox=True, config: dict | None = None):
    tokens = positions.shape[0]
    n_q_heads, n_k_heads = q.shape[1], k.shape[1]
    half_rotary = cos_sin_cache.shape[-1] // 2
    if tokens == 0:
        return q, k
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()  # read-only: a copy is harmless here
    block_r = triton.next_power_of_2(half_rotary)
    if config is None:
        shape = rope_tuning_shape(q, k, cos_sin_cache, is_neox)
        config = lookup("rotary_embedding", q.dtype, shape, q.device)
    config = check_block_config(
        "rotary_embedding", config or _heuristic(n_q_heads, n_k_heads, block_r), ("BLOCK_H",)
    )
    block_h = config["BLOCK_H"]
    head_blocks = triton.cdiv(n_q_heads, block_h) + triton.cdiv(n_k_heads, block_h)
    _rotary_kernel[(tokens, head_blocks)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        n_q_heads,
        n_k_heads,
        half_rotary,
        IS_NEOX=bool(is_neox),
        BLOCK_H=block_h,
        BLOCK_R=block_r,
        num_warps=config["num_warps"],
    )
    return q, k


ROTARY_EMBEDDING.register(
    Implementation("triton", rotary_embedding_triton, triton_available, configs=rotary_configs)
)
