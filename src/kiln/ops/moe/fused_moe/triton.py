"""Triton fused MoE: two grouped GEMMs over all experts plus a top-k sum.

After `moe_align_block_size`, every BLOCK_M rows of `sorted_pair_ids` belong to one expert, so one
launch covers all experts: a program owns a [BLOCK_M, BLOCK_N] output tile of one M-block, reads its
expert from `block_expert_ids`, gathers its rows (token = pair // top_k) and streams that expert's
weight tile along K. Programs past the padded length exit at once, so the grid is static. A pair
whose expert id is out of range (unchecked inside `trusted_inputs()`) is in no M-block and adds
nothing, so no kernel indexes past the expert weights.

  1. gate_up: h[pair] = silu(x[token] @ W_gate[e]^T) * (x[token] @ W_up[e]^T), both accumulators in
     one program (the gate and up tiles share the x tile), h in x's dtype, [num_pairs, N].
  2. down:    partial[pair] = topk_weight[pair] * (h[pair] @ W_down[e]^T), float32 [num_pairs, K].
  3. sum:     out[t] = sum_j partial[t * top_k + j] (skipped for top_k == 1: step 2 writes out).
Programs are ordered in groups of GROUP_M M-blocks per N-column sweep (Triton's matmul tutorial), so
consecutive programs reuse the same expert's weight tiles from L2. FP8 weights are converted to x's
dtype in registers (W8A16) and the per-expert scale is applied to the fp32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty
from kiln.ops.moe.align import fits_single_program, moe_align_block_size, moe_align_block_size_triton
from kiln.ops.moe.fused_moe.spec import FUSED_MOE
from kiln.ops.registry import Implementation, triton_available, triton_interpreting


@triton.jit
def _tile(pid, num_m_blocks, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering: program id -> (M-block, N-block)."""
    num_n_blocks = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    h_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_m_blocks,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_h,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), num_m_blocks, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs  # padding slots hold the sentinel num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    # Scalar 64-bit bases, 32-bit tile offsets (the launcher keeps them < 2^31): 64-bit pointer
    # tiles carried through the K loop would cost two registers per element and spill.
    x_offsets = (pairs // TOP_K)[:, None] * stride_x + offs_k[None, :]
    w_expert = w_ptr + expert * stride_we
    # Weight tiles are read transposed ([BLOCK_K, BLOCK_N]) straight from the [2N, K] layout.
    gate_offsets = offs_n[None, :] * stride_wn + offs_k[:, None]
    up_offsets = gate_offsets + N * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptr + k0 + x_offsets, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(w_expert + k0 + gate_offsets, mask=w_mask, other=0.0).to(a.dtype)
        w_up = tl.load(w_expert + k0 + up_offsets, mask=w_mask, other=0.0).to(a.dtype)
        gate = tl.dot(a, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
    if HAS_SCALE:
        scale = tl.load(w_scale_ptr + expert)
        gate *= scale
        up *= scale
    hidden = gate / (1.0 + tl.exp(-gate)) * up
    h_offsets = pairs[:, None] * stride_h + offs_n[None, :]
    tl.store(h_ptr + h_offsets, hidden.to(h_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr,
    w_ptr,
    w_scale_ptr,
    topk_weights_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_m_blocks,
    N_OUT,
    K,
    stride_h,
    stride_we,
    stride_wn,
    stride_out,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), num_m_blocks, N_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_mask = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_OUT
    offs_k = tl.arange(0, BLOCK_K)

    h_offsets = pairs[:, None] * stride_h + offs_k[None, :]
    w_expert = w_ptr + expert * stride_we
    w_offsets = offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(h_ptr + k0 + h_offsets, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_expert + k0 + w_offsets, mask=k_mask[:, None] & n_mask[None, :], other=0.0).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    route_weight = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        route_weight *= tl.load(w_scale_ptr + expert)
    acc *= route_weight[:, None]
    out_offsets = pairs[:, None] * stride_out + offs_n[None, :]
    tl.store(
        out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :]
    )


@triton.jit
def _moe_sum_kernel(
    partial_ptr, topk_ids_ptr, out_ptr, hidden, num_experts, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr
):
    """out[t, :] = sum_j partial[t * TOP_K + j, :]; one program per (token, column block). A pair
    whose expert id is out of range is in no GEMM block, so its partial row was never written: skip it."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(topk_ids_ptr + token * TOP_K + j)
        # The row's width, 0 for a skipped pair (a scalar-and-vector mask `&` is wrong in the interpreter).
        width = tl.where((expert >= 0) & (expert < num_experts), hidden, 0)
        acc += tl.load(partial_ptr + (token * TOP_K + j) * hidden + cols, mask=cols < width, other=0.0)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


INT32_LIMIT = 2**31 - 1
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_N_DOWN", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def heuristic_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tile sizes by tokens per expert: few (decode) -> thin M tiles and long K steps, the GEMMs are
    weight streams and need many N-blocks to keep every SM reading; many (prefill) -> big tiles for
    tensor-core throughput. The gate_up kernel holds two [BLOCK_M, BLOCK_N] accumulators, so the
    down kernel's single accumulator gets BLOCK_N_DOWN (2 * BLOCK_N: the same register budget)."""
    if triton_interpreting():  # the interpreter's cost grows with tile size, not program count
        return dict(zip(CONFIG_KEYS, (16, 32, 32, 32, 1, 4, 1), strict=True))
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        tiles = (16, 64, 64, 128, 1, 4, 4)  # decode: hidden / 64 down N-blocks per active expert
    elif per_expert <= 96:
        tiles = (32, 64, 128, 128, 4, 4, 4)
    elif per_expert <= 512:
        tiles = (64, 64, 128, 64, 8, 4, 4)
    else:
        tiles = (128, 64, 128, 64, 8, 8, 3)
    config = dict(zip(CONFIG_KEYS, tiles, strict=True))
    if dtype == torch.float32:  # exact fp32 dots run on FMA units: smaller tiles avoid register spills
        config.update(
            BLOCK_M=min(config["BLOCK_M"], 64), BLOCK_N=32, BLOCK_N_DOWN=64, BLOCK_K=32, num_stages=3
        )
    return config


def configs(shape: dict, dtype: torch.dtype) -> list[dict]:
    """The tuning search space (BLOCK_N is per accumulator of the gate_up kernel)."""
    space = []
    for block_m in (16, 32, 64, 128):
        for block_n in (32, 64, 128):
            for block_k in (64, 128):
                for num_warps, num_stages in ((4, 3), (4, 4), (8, 3)):
                    if block_m * block_n >= 128 * 128 and num_warps == 4:
                        continue
                    group_m = 1 if block_m == 16 else 8
                    for block_n_down in (block_n, 2 * block_n):
                        tiles = (block_m, block_n, block_n_down, block_k, group_m, num_warps, num_stages)
                        space.append(dict(zip(CONFIG_KEYS, tiles, strict=True)))
    return space


def _shape_key(x, w_gate_up, topk_ids, fp8):
    """The tuning-cache key, the launcher's one definition of it (`kiln tune` runs the launcher up to
    its lookup and stores under what it asks for). `fp8` is in it: fp8 weights are half the bytes
    streamed per tile plus an in-register convert, so the best BLOCK_K/BLOCK_N and stage count can differ
    from the half-precision weights' (decode is a weight stream). The spec's `skew` is not: it shapes
    the routing, which is data a launcher could key on only by reading topk_ids back (a device sync)."""
    return {
        "tokens": x.shape[0],
        "hidden": x.shape[1],
        "intermediate": w_gate_up.shape[1] // 2,
        "experts": w_gate_up.shape[0],
        "top_k": topk_ids.shape[1],
        "fp8": fp8,
    }


def fused_moe_triton(
    x,
    w_gate_up,
    w_down,
    topk_weights,
    topk_ids,
    w_gate_up_scale=None,
    w_down_scale=None,
    config: dict | None = None,
):
    num_tokens, hidden = x.shape
    num_experts, two_n, _ = w_gate_up.shape
    inter, top_k = two_n // 2, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if 2 * inter * hidden >= INT32_LIMIT:
        raise ValueError(
            f"fused_moe: one expert's w_gate_up has {2 * inter * hidden} elements; the Triton "
            f"kernel indexes an expert with 32-bit offsets (limit {INT32_LIMIT})"
        )
    rows_limit = INT32_LIMIT // (top_k * max(x.stride(0), hidden, inter))
    if num_tokens > rows_limit:  # keep every activation offset within 32 bits: run in token chunks
        out = empty((num_tokens, hidden), x.dtype, x.device)
        for start in range(0, num_tokens, rows_limit):
            end = min(start + rows_limit, num_tokens)
            out[start:end] = fused_moe_triton(
                x[start:end],
                w_gate_up,
                w_down,
                topk_weights[start:end],
                topk_ids[start:end],
                w_gate_up_scale,
                w_down_scale,
                config,
            )
        return out
    if top_k == 1:
        # The down GEMM writes `out` itself, and a token whose expert id is out of range is in no
        # block (align.py), so its row must start at zero: it adds nothing, as in the reference.
        out = torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    else:
        out = empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    if config is None:
        from kiln.ops.tuned_configs import lookup

        fp8 = w_gate_up.dtype == torch.float8_e4m3fn
        config = lookup("fused_moe", x.dtype, _shape_key(x, w_gate_up, topk_ids, fp8), x.device)
        config = config or heuristic_config(num_pairs, num_experts, x.dtype)
    block_m, block_n, block_k = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    # fp32 inputs would otherwise be rounded to tf32 on the GPU; halves take the default.
    precision = "ieee" if x.dtype == torch.float32 else None

    x = x if x.stride(-1) == 1 else x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    align = (
        moe_align_block_size_triton if fits_single_program(num_pairs, num_experts) else moe_align_block_size
    )
    sorted_pair_ids, block_expert_ids, num_padded = align(topk_ids, num_experts, block_m)
    num_m_blocks = block_expert_ids.numel()

    h = empty((num_pairs, inter), x.dtype, x.device)
    has_scale = w_gate_up_scale is not None
    gate_up_scale = w_gate_up_scale.float().contiguous() if has_scale else x
    grid = (num_m_blocks * triton.cdiv(inter, block_n),)
    _moe_gate_up_kernel[grid](
        x,
        w_gate_up,
        gate_up_scale,
        h,
        sorted_pair_ids,
        block_expert_ids,
        num_padded,
        num_pairs,
        num_m_blocks,
        inter,
        hidden,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        h.stride(0),
        TOP_K=top_k,
        HAS_SCALE=has_scale,
        DOT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=config["GROUP_M"],
        **launch,
    )

    # top_k == 1: pair id == token id, so the down GEMM writes the output directly.
    partial = out if top_k == 1 else empty((num_pairs, hidden), torch.float32, x.device)
    down_scale = w_down_scale.float().contiguous() if w_down_scale is not None else x
    block_n_down = config.get("BLOCK_N_DOWN", 2 * block_n)
    grid = (num_m_blocks * triton.cdiv(hidden, block_n_down),)
    _moe_down_kernel[grid](
        h,
        w_down,
        down_scale,
        topk_weights,
        partial,
        sorted_pair_ids,
        block_expert_ids,
        num_padded,
        num_pairs,
        num_m_blocks,
        hidden,
        inter,
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        partial.stride(0),
        HAS_SCALE=w_down_scale is not None,
        DOT_PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n_down,
        BLOCK_K=block_k,
        GROUP_M=config["GROUP_M"],
        **launch,
    )
    if top_k > 1:
        block_h = min(triton.next_power_of_2(hidden), 1024)
        _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            partial, topk_ids, out, hidden, num_experts, TOP_K=top_k, BLOCK_H=block_h, num_warps=4
        )
    return out


FUSED_MOE.register(Implementation("triton", fused_moe_triton, triton_available, configs=configs))
