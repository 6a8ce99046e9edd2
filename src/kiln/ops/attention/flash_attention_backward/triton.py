"""Triton flash_attention_backward: FlashAttention-2's backward as two kernels, no atomics.

1. `_backward_dq_kernel`: one program owns BLOCK_OWNED queries of one head of one sequence. It first
   computes delta = rowsum(dO * O) - grad_lse for its rows (FA2's preprocess, fused here: the program
   loads dO anyway) and stores it, then streams the visible keys BLOCK_STREAMED at a time, recomputing
   P = exp2(s - lse) from the saved LSE and accumulating dQ += dS K in float32 registers.
2. `_backward_dkdv_kernel` (after the first, which wrote delta): one program owns BLOCK_OWNED keys of
   one kv head of one sequence. It loops over the query heads of its GQA group and streams their
   visible queries BLOCK_STREAMED at a time, accumulating dV += P^T dO and dK += dS^T Q in registers,
   so dk/dv are summed over the group without atomics.

Every gradient element is written by exactly one program with a fixed summation order, so the
result is the same on every run (deterministic, no atomics, no zero-initialized accumulators in
memory). The cost is recomputing the scores twice (once per kernel) instead of once.

Causal masks are bottom-right aligned (query i sits at key position i + k_len - q_len) and a sliding
window keeps position - j < window; tile ranges skip what these hide entirely, and every tile applies
the full mask (tiles wholly visible are not specialized yet). Scores are in base 2 (exp2).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty, empty_like
from kiln.ops.attention.flash_attention_backward.spec import FLASH_ATTENTION_BACKWARD, backward_tune_shape
from kiln.ops.registry import Implementation, triton_available, triton_interpreting
from kiln.ops.tuned_configs import lookup


@triton.jit
def _probs(
    q, k, lse2, offs_m, offs_n, q_len, k_len, shift, qk_scale, softcap, window, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """P [BLOCK_Q, BLOCK_K] = exp(s - lse) for a query tile and a key tile (0 where masked), and
    d(capped score)/d(score) = 1 - tanh^2 when soft-capping (else P again, unused)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    slope = s
    if HAS_SOFTCAP:
        # tanh(y) = 1 - 2 / (e^{2y} + 1): saturates cleanly at +-1 (as the forward kernel).
        t = 1.0 - 2.0 / (tl.exp2(s * (qk_scale / softcap) * 2.8853900817779268) + 1.0)
        slope = 1.0 - t * t
        s2 = t * (softcap * 1.4426950408889634)
    else:
        s2 = s * (qk_scale * 1.4426950408889634)
    positions = offs_m + shift
    visible = (offs_m[:, None] < q_len) & (offs_n[None, :] < k_len)
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= positions[:, None])
    if HAS_WINDOW:
        visible = visible & (positions[:, None] - offs_n[None, :] < window)
    p = tl.where(visible, tl.exp2(s2 - lse2[:, None]), 0.0)
    return p, slope


@triton.jit
def _load_rows(ptr, rows, stride_t, head_offset, offs_d, n_rows, HEAD_DIM: tl.constexpr):
    """[len(rows), BLOCK_D] of a [tokens, heads, D] tensor: zeros past n_rows and past HEAD_DIM."""
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(
        ptr + rows.to(tl.int64)[:, None] * stride_t + head_offset + offs_d[None, :], mask=mask, other=0.0
    )


@triton.jit
def _load_lse2(lse_ptr, head, stride_lse_h, q_start, offs_m, q_len):
    """The saved LSE of rows offs_m in base 2; -inf (a query that sees no key) and padding as 0, so
    exp2(-inf - lse2) stays 0 instead of NaN."""
    lse = tl.load(lse_ptr + head * stride_lse_h + q_start + offs_m, mask=offs_m < q_len, other=0.0)
    return tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)


@triton.jit
def _backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, dout_ptr, lse_ptr, grad_lse_ptr, delta_ptr, dq_ptr, cu_seqlens_q_ptr,
    cu_seqlens_k_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_lse_h, num_queries_per_kv,
    sm_scale, softcap, window, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, IEEE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_Q
    if m0 >= q_len:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    kv_head = head // num_queries_per_kv
    offs_m = m0 + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = q_start + offs_m
    q_head_offset = head.to(tl.int64) * stride_qh
    q = _load_rows(q_ptr, q_rows, stride_qt, q_head_offset, offs_d, q_start + q_len, HEAD_DIM)
    dout = _load_rows(dout_ptr, q_rows, stride_qt, q_head_offset, offs_d, q_start + q_len, HEAD_DIM)
    out = _load_rows(out_ptr, q_rows, stride_qt, q_head_offset, offs_d, q_start + q_len, HEAD_DIM)
    delta = tl.sum(dout.to(tl.float32) * out.to(tl.float32), 1)
    lse_offsets = head * stride_lse_h + q_start + offs_m
    if HAS_GRAD_LSE:
        delta -= tl.load(grad_lse_ptr + lse_offsets, mask=offs_m < q_len, other=0.0)
    tl.store(delta_ptr + lse_offsets, delta, mask=offs_m < q_len)
    lse2 = _load_lse2(lse_ptr, head, stride_lse_h, q_start, offs_m, q_len)

    # Keys this tile can see: causal stops after the last row's position, the window starts at the
    # first row's position - window + 1 (rounded down to a tile).
    shift = k_len - q_len
    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, m0 + BLOCK_Q + shift)
    if HAS_WINDOW:
        lo = tl.maximum(m0 + shift - window + 1, 0) // BLOCK_K * BLOCK_K
    kv_head_offset = kv_head.to(tl.int64) * stride_kh
    dq = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_K):
        offs_n = start + tl.arange(0, BLOCK_K)
        k = _load_rows(k_ptr, k_start + offs_n, stride_kt, kv_head_offset, offs_d, k_start + k_len, HEAD_DIM)
        v = _load_rows(v_ptr, k_start + offs_n, stride_kt, kv_head_offset, offs_d, k_start + k_len, HEAD_DIM)
        p, slope = _probs(
            q, k, lse2, offs_m, offs_n, q_len, k_len, shift, sm_scale, softcap, window, CAUSAL, HAS_WINDOW,
            HAS_SOFTCAP, IEEE,
        )  # fmt: skip
        if IEEE:
            dp = tl.dot(dout, tl.trans(v), input_precision="ieee")
        else:
            dp = tl.dot(dout, tl.trans(v))
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * slope
        if IEEE:
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * sm_scale
    mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    ptrs = dq_ptr + q_rows.to(tl.int64)[:, None] * stride_qt + q_head_offset + offs_d[None, :]
    tl.store(ptrs, dq.to(dq_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lse_h, num_queries_per_kv, sm_scale, softcap, window,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    n0 = tile * BLOCK_K
    if n0 >= k_len:
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    offs_n = n0 + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    k_rows = k_start + offs_n
    kv_head_offset = kv_head.to(tl.int64) * stride_kh
    k = _load_rows(k_ptr, k_rows, stride_kt, kv_head_offset, offs_d, k_start + k_len, HEAD_DIM)
    v = _load_rows(v_ptr, k_rows, stride_kt, kv_head_offset, offs_d, k_start + k_len, HEAD_DIM)

    # Queries that can see this tile: causal starts at the first key's row (j - shift), the window
    # ends after the last key's row + window - 1.
    shift = k_len - q_len
    lo = 0
    hi = q_len
    if CAUSAL:
        lo = tl.maximum(n0 - shift, 0) // BLOCK_Q * BLOCK_Q
    if HAS_WINDOW:
        hi = tl.minimum(q_len, n0 + BLOCK_K - 1 - shift + window)
    dk = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
    for group_index in range(0, num_queries_per_kv):
        head = kv_head * num_queries_per_kv + group_index
        q_head_offset = head.to(tl.int64) * stride_qh
        for start in range(lo, hi, BLOCK_Q):
            offs_m = start + tl.arange(0, BLOCK_Q)
            q_rows = q_start + offs_m
            q = _load_rows(q_ptr, q_rows, stride_qt, q_head_offset, offs_d, q_start + q_len, HEAD_DIM)
            dout = _load_rows(dout_ptr, q_rows, stride_qt, q_head_offset, offs_d, q_start + q_len, HEAD_DIM)
            lse2 = _load_lse2(lse_ptr, head, stride_lse_h, q_start, offs_m, q_len)
            delta = tl.load(
                delta_ptr + head * stride_lse_h + q_start + offs_m, mask=offs_m < q_len, other=0.0
            )
            p, slope = _probs(
                q, k, lse2, offs_m, offs_n, q_len, k_len, shift, sm_scale, softcap, window, CAUSAL,
                HAS_WINDOW, HAS_SOFTCAP, IEEE,
            )  # fmt: skip
            if IEEE:
                dv += tl.dot(tl.trans(p), dout, input_precision="ieee")
                dp = tl.dot(dout, tl.trans(v), input_precision="ieee")
            else:
                dv += tl.dot(tl.trans(p.to(dout.dtype)), dout)
                dp = tl.dot(dout, tl.trans(v))
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * slope
            if IEEE:
                dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
            else:
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    dk = dk * sm_scale
    mask = (offs_n[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM)
    offsets = k_rows.to(tl.int64)[:, None] * stride_kt + kv_head_offset + offs_d[None, :]
    tl.store(dk_ptr + offsets, dk.to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(dv_ptr + offsets, dv.to(dv_ptr.dtype.element_ty), mask=mask)


def backward_configs(shape: dict, dtype: torch.dtype) -> list[dict]:
    """The `kiln tune` search space: the owned side larger than the streamed one (FA2's backward)."""
    big_head = shape["head_dim"] > 128
    configs = []
    for owned, streamed, warps, stages in itertools.product((32, 64, 128), (16, 32, 64), (4, 8), (1, 2, 3)):
        if big_head and (owned * streamed > 64 * 32 or stages > 2):
            continue
        configs.append(
            {"BLOCK_OWNED": owned, "BLOCK_STREAMED": streamed, "num_warps": warps, "num_stages": stages}
        )
    return configs


def heuristic_config(head_dim: int) -> dict:
    """The untuned launch config (not tuned on hardware yet): a program keeps its owned tile, its two
    float32 accumulators and the streamed tiles in registers, so big heads get smaller tiles."""
    if triton_interpreting():  # small tiles: several per test sequence, and the interpreter is slow
        return {"BLOCK_OWNED": 16, "BLOCK_STREAMED": 16, "num_warps": 4, "num_stages": 1}
    if head_dim > 128:
        return {"BLOCK_OWNED": 64, "BLOCK_STREAMED": 16, "num_warps": 8, "num_stages": 1}
    if head_dim > 64:
        return {"BLOCK_OWNED": 64, "BLOCK_STREAMED": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_OWNED": 64, "BLOCK_STREAMED": 32, "num_warps": 4, "num_stages": 2}


def flash_attention_backward_triton(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
    scale=None, sliding_window=None, softcap=None, grad_lse=None, config=None,
):  # fmt: skip
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads, _ = k.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    # One layout for the [T, H, D] tensors (and one for k/v) keeps the kernels' stride lists short.
    q, dout, out = (t.contiguous() for t in (q, dout, out))
    k, v = k.contiguous(), v.contiguous()
    lse = lse.float().contiguous()
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    if total_q == 0 or num_heads == 0 or num_seqs == 0:  # no query reads any key
        return dq, dk.zero_(), dv.zero_()
    if total_k == 0:  # no key: every query sees nothing
        return dq.zero_(), dk, dv
    if config is None:
        shape = backward_tune_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal)
        config = lookup("flash_attention_backward", q.dtype, shape) or heuristic_config(head_dim)
    owned, streamed = config["BLOCK_OWNED"], config["BLOCK_STREAMED"]
    delta = empty((num_heads, total_q), torch.float32, q.device)
    grad_lse = grad_lse.float().contiguous() if grad_lse is not None else None
    common = dict(
        HEAD_DIM=head_dim, CAUSAL=causal, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, IEEE=q.dtype == torch.float32,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=config.get("num_warps", 4),
        num_stages=config.get("num_stages", 1),
    )  # fmt: skip
    scalars = (
        num_heads // num_kv_heads,
        head_dim**-0.5 if scale is None else scale,
        float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
    )
    _backward_dq_kernel[(triton.cdiv(max_seqlen_q, owned), num_seqs, num_heads)](
        q, k, v, out, dout, lse, grad_lse if grad_lse is not None else lse, delta, dq, cu_seqlens_q,
        cu_seqlens_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0), *scalars,
        HAS_GRAD_LSE=grad_lse is not None, BLOCK_Q=owned, BLOCK_K=streamed, **common,
    )  # fmt: skip
    _backward_dkdv_kernel[(triton.cdiv(max_seqlen_k, owned), num_seqs, num_kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, cu_seqlens_q, cu_seqlens_k, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), lse.stride(0), *scalars, BLOCK_Q=streamed, BLOCK_K=owned, **common,
    )  # fmt: skip
    return dq, dk, dv


FLASH_ATTENTION_BACKWARD.register(
    Implementation("triton", flash_attention_backward_triton, triton_available, configs=backward_configs)
)
