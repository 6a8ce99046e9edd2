"""The FlashAttention-2 style Triton kernel shared by flash_attention (contiguous varlen K/V) and
paged_prefill_attention (K/V read from the paged cache through block_tables), its launcher and its
configs. The ops' own launchers are flash_attention/triton.py and paged_prefill_attention/triton.py.

Tiling: one program owns BLOCK_M queries of one head of one sequence (grid = query tiles x
sequences x heads). It streams the sequence's keys and values in BLOCK_N tiles, keeping a running
row max, row sum and output accumulator in float32 registers (online softmax, base 2), so the
[q_len, k_len] score matrix never exists. The key range a tile needs is computed up front: tiles
that causality or the sliding window hide entirely are never loaded, and only the tiles on the
diagonal / window edge / sequence end pay for the mask.

Exact positions (paged_prefill_attention over an fp8 cache, spec.py): `_paged_prefill_exact_kernel`
runs the same program with HAS_EXACT, which overlays each key/value tile's exact positions (the
sequence's first block and its last exact_window positions) with the float16 exact caches' values
after the fp8 tile is converted, before the scales folded into the scores and the output apply (the
exact values are in the fp8 cache's units). A tile that overlaps neither the first block nor the
window skips the overlay with one scalar branch, so interior tiles read only the fp8 cache. Every
other launch (flash_attention, paged without exact caches) is `_prefill_kernel`, with its signature
and its code as before: HAS_EXACT is False there and the overlay's code does not exist.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty, empty_like
from kiln.ops.attention.triton_exact import exact_kernel_args, overlay_exact_tile, tile_has_exact
from kiln.ops.attention.validate import FP8_DTYPES
from kiln.ops.registry import triton_interpreting


@triton.jit
def _load_kv_tile(
    base_ptr, head_offset, offs_n, offs_d, k_start, k_len, seq, block_tables_ptr, stride_bt, stride_block,
    stride_token, num_blocks, HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MASK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, BLOCK_D] keys (or values) of tokens offs_n; zeros past k_len and past HEAD_DIM."""
    in_range = offs_n < k_len
    if PAGED:
        if MASK_N:
            block = tl.load(block_tables_ptr + seq * stride_bt + offs_n // PAGE_SIZE, mask=in_range, other=0)
        else:
            block = tl.load(block_tables_ptr + seq * stride_bt + offs_n // PAGE_SIZE)
        # Unchecked tables (kiln.ops.trusted_inputs) may hold entries outside the cache: clamped, a bad
        # entry gives wrong values for its own sequence but never a read outside the cache.
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1)
        rows = block.to(tl.int64) * stride_block + (offs_n % PAGE_SIZE) * stride_token
    else:
        rows = (k_start + offs_n).to(tl.int64) * stride_token
    ptrs = base_ptr + head_offset + rows[:, None] + offs_d[None, :]
    # Interior tiles of power-of-two head dims load unmasked (cleanest for async copies).
    if MASK_N:
        if BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=in_range[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        return tl.load(ptrs, mask=in_range[:, None], other=0.0)
    if BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, lo, hi, positions, k_ptr, v_ptr, k_head_offset, v_head_offset, k_start, k_len, seq,
    block_tables_ptr, stride_bt, stride_kb, stride_kt, stride_vb, stride_vt, num_blocks, qk_scale, softcap,
    window, exact_row_ptr, exact_k_head_ptr, exact_v_head_ptr, stride_ekb, stride_ekt, stride_evb,
    stride_evt, num_exact_blocks, exact_ring, exact_window_start, HEAD_DIM: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_EXACT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Fold key tiles [lo, hi) into the running (acc, m_i, l_i); MASKED tiles apply the bounds,
    causal and window masks, the others are known to be fully visible. HAS_EXACT: tiles that hold
    exact positions get them from the exact caches (overlay_exact_tile)."""
    offs_d = tl.arange(0, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k = _load_kv_tile(
            k_ptr, k_head_offset, offs_n, offs_d, k_start, k_len, seq, block_tables_ptr, stride_bt, stride_kb,
            stride_kt, num_blocks, HEAD_DIM, PAGED, PAGE_SIZE, MASKED, BLOCK_D,
        ).to(q.dtype)  # fmt: skip
        if HAS_EXACT:
            tile_end = tl.minimum(start + BLOCK_N, k_len)
            has_exact = tile_has_exact(start, tile_end, exact_window_start, PAGE_SIZE)
            if has_exact:
                k = overlay_exact_tile(
                    k, offs_n, offs_d, offs_n < k_len, exact_window_start, exact_row_ptr, exact_k_head_ptr,
                    stride_ekb, stride_ekt, num_exact_blocks, exact_ring, HEAD_DIM, PAGE_SIZE,
                )  # fmt: skip
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP:
            # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (e^{2y} + 1): saturates cleanly at +-1.
            y = s * qk_scale / softcap
            s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp2(y * 2.8853900817779268) + 1.0))
        else:
            s = s * qk_scale
        if MASKED:
            visible = offs_n[None, :] < k_len
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= positions[:, None])
            if HAS_WINDOW:
                visible = visible & (positions[:, None] - offs_n[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps max -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(
            v_ptr, v_head_offset, offs_n, offs_d, k_start, k_len, seq, block_tables_ptr, stride_bt, stride_vb,
            stride_vt, num_blocks, HEAD_DIM, PAGED, PAGE_SIZE, MASKED, BLOCK_D,
        ).to(q.dtype)  # fmt: skip
        if HAS_EXACT:
            if has_exact:
                v = overlay_exact_tile(
                    v, offs_n, offs_d, offs_n < k_len, exact_window_start, exact_row_ptr, exact_v_head_ptr,
                    stride_evb, stride_evt, num_exact_blocks, exact_ring, HEAD_DIM, PAGE_SIZE,
                )  # fmt: skip
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_program(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seq_lens_ptr, block_tables_ptr,
    k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_lse_h, stride_bt, num_blocks, table_width, num_queries_per_kv,
    sm_scale, softcap, window, exact_k_ptr, exact_v_ptr, exact_tables_ptr, stride_ekb, stride_ekt, stride_ekh,
    stride_evb, stride_evt, stride_evh, stride_et, num_exact_blocks, exact_ring, exact_window,
    HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KV_SCALE: tl.constexpr, HAS_EXACT: tl.constexpr,
    RETURN_LSE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program of both kernels below (inlined into each): BLOCK_M queries of one head of one
    sequence. HAS_EXACT (paged, fp8 cache): exact caches [num_exact_blocks, PAGE_SIZE, Hkv, D] and
    their table [num_seqs, 1 + R] (exact_ring = max(R, 1)), see overlay_exact_tile."""
    # Heaviest (last, under causality) query tiles first, so the tail of the grid is short work.
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = tile_m * BLOCK_M
    if m0 >= q_len:
        return
    if PAGED:
        k_start = 0
        k_len = tl.minimum(tl.load(seq_lens_ptr + seq), table_width * PAGE_SIZE)  # never past the table row
    else:
        k_start = tl.load(cu_seqlens_k_ptr + seq)
        k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    kv_head = head // num_queries_per_kv

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = (q_start + offs_m).to(tl.int64)
    q_mask = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
    )

    qk_scale = sm_scale
    if HAS_KV_SCALE:  # fp8 cache: fold the key scale into the score scale
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    if not HAS_SOFTCAP:
        qk_scale = qk_scale * 1.4426950408889634  # scores in base 2 for exp2

    # Bottom-right alignment: query row i sits at key position i + shift.
    shift = k_len - q_len
    positions = offs_m + shift
    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(k_len, m0 + BLOCK_M + shift)
    if HAS_WINDOW:
        lo = tl.maximum(m0 + shift - window + 1, 0) // BLOCK_N * BLOCK_N
    # Tiles in [full_lo, full_hi) are visible to every row of this tile: no mask needed.
    full_lo = lo
    full_hi = k_len // BLOCK_N * BLOCK_N
    if CAUSAL:
        full_hi = tl.minimum(full_hi, tl.maximum(m0 + shift + 1, 0) // BLOCK_N * BLOCK_N)
    if HAS_WINDOW:
        last_row = tl.minimum(m0 + BLOCK_M, q_len) - 1 + shift
        full_lo = (tl.maximum(last_row - window + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.maximum(hi, lo))
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k_head_offset = kv_head.to(tl.int64) * stride_kh
    v_head_offset = kv_head.to(tl.int64) * stride_vh
    # The exact window follows the context's end: the same positions for every query of the sequence.
    exact_row_ptr = exact_tables_ptr + seq.to(tl.int64) * stride_et
    exact_k_head_ptr = exact_k_ptr + kv_head.to(tl.int64) * stride_ekh
    exact_v_head_ptr = exact_v_ptr + kv_head.to(tl.int64) * stride_evh
    exact_window_start = k_len - exact_window
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, lo, full_lo, positions, k_ptr, v_ptr, k_head_offset, v_head_offset, k_start,
        k_len, seq, block_tables_ptr, stride_bt, stride_kb, stride_kt, stride_vb, stride_vt, num_blocks,
        qk_scale, softcap, window, exact_row_ptr, exact_k_head_ptr, exact_v_head_ptr, stride_ekb, stride_ekt,
        stride_evb, stride_evt, num_exact_blocks, exact_ring, exact_window_start, HEAD_DIM, PAGED, PAGE_SIZE,
        True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_EXACT, IEEE, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, full_lo, full_hi, positions, k_ptr, v_ptr, k_head_offset, v_head_offset, k_start,
        k_len, seq, block_tables_ptr, stride_bt, stride_kb, stride_kt, stride_vb, stride_vt, num_blocks,
        qk_scale, softcap, window, exact_row_ptr, exact_k_head_ptr, exact_v_head_ptr, stride_ekb, stride_ekt,
        stride_evb, stride_evt, num_exact_blocks, exact_ring, exact_window_start, HEAD_DIM, PAGED, PAGE_SIZE,
        False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_EXACT, IEEE, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, full_hi, hi, positions, k_ptr, v_ptr, k_head_offset, v_head_offset, k_start,
        k_len, seq, block_tables_ptr, stride_bt, stride_kb, stride_kt, stride_vb, stride_vt, num_blocks,
        qk_scale, softcap, window, exact_row_ptr, exact_k_head_ptr, exact_v_head_ptr, stride_ekb, stride_ekt,
        stride_evb, stride_evt, num_exact_blocks, exact_ring, exact_window_start, HEAD_DIM, PAGED, PAGE_SIZE,
        True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_EXACT, IEEE, BLOCK_N, BLOCK_D,
    )  # fmt: skip

    # A query that sees no key at all (only possible with k_len < q_len) gets 0 and lse -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if HAS_KV_SCALE:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )
    if RETURN_LSE:
        # m_i and the sum are in base 2; ln(sum e^s) = (m + log2(l)) * ln 2.
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        tl.store(lse_ptr + head * stride_lse_h + q_start + offs_m, lse, mask=offs_m < q_len)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seq_lens_ptr, block_tables_ptr,
    k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_lse_h, stride_bt, num_blocks, table_width, num_queries_per_kv,
    sm_scale, softcap, window, HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KV_SCALE: tl.constexpr,
    RETURN_LSE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """flash_attention and paged_prefill_attention without exact positions (the exact arguments are
    placeholders HAS_EXACT=False never reads)."""
    _prefill_program(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seq_lens_ptr,
        block_tables_ptr, k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h, stride_bt, num_blocks,
        table_width, num_queries_per_kv, sm_scale, softcap, window, k_ptr, v_ptr, block_tables_ptr, 0, 0,
        0, 0, 0, 0, 0, 1, 1, 0, HEAD_DIM, PAGED, PAGE_SIZE, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_KV_SCALE,
        False, RETURN_LSE, IEEE, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _paged_prefill_exact_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seq_lens_ptr, block_tables_ptr,
    k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_ot, stride_oh, stride_lse_h, stride_bt, num_blocks, table_width, num_queries_per_kv,
    sm_scale, softcap, window, exact_k_ptr, exact_v_ptr, exact_tables_ptr, stride_ekb, stride_ekt, stride_ekh,
    stride_evb, stride_evt, stride_evh, stride_et, num_exact_blocks, exact_ring, exact_window,
    HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KV_SCALE: tl.constexpr,
    RETURN_LSE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """paged_prefill_attention over an fp8 cache with exact positions (PAGED, HAS_KV_SCALE)."""
    _prefill_program(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, seq_lens_ptr,
        block_tables_ptr, k_scale_ptr, v_scale_ptr, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h, stride_bt, num_blocks,
        table_width, num_queries_per_kv, sm_scale, softcap, window, exact_k_ptr, exact_v_ptr,
        exact_tables_ptr, stride_ekb, stride_ekt, stride_ekh, stride_evb, stride_evt, stride_evh, stride_et,
        num_exact_blocks, exact_ring, exact_window, HEAD_DIM, PAGED, PAGE_SIZE, CAUSAL, HAS_WINDOW,
        HAS_SOFTCAP, HAS_KV_SCALE, True, RETURN_LSE, IEEE, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


def prefill_configs(shape: dict, dtype: torch.dtype) -> list[dict]:
    """The `kiln tune` search space: Hopper-sized tiles, fewer for head_dim 256 (register pressure)."""
    big_head = shape["head_dim"] > 128
    configs = []
    for block_m, block_n, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        if big_head and (block_m * block_n > 64 * 64 or stages > 2):
            continue
        configs.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages})
    return configs


def heuristic_config(head_dim: int, max_seqlen_q: int) -> dict:
    """The untuned launch config: Hopper-sized tiles by head dim, smaller query tiles for short chunks."""
    if triton_interpreting():  # small tiles: many tiles per test sequence, and the interpreter is slow
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if head_dim > 128:
        config = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    elif head_dim > 64:
        config = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    else:
        config = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    # Short query chunks (chunked prefill, mixed batches) waste less with a smaller query tile.
    config["BLOCK_M"] = max(16, min(config["BLOCK_M"], triton.next_power_of_2(max(max_seqlen_q, 1))))
    return config


def launch_prefill(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seq_lens, block_tables, k_scale, v_scale, max_seqlen_q, causal,
    scale, sliding_window, softcap, return_lse, paged, config, exact=None,
):  # fmt: skip
    """Run the kernel: contiguous varlen k/v `[total_k, Hkv, D]` (paged=False, sequences delimited by
    cu_seqlens_k) or paged caches `[num_blocks, block_size, Hkv, D]` (paged=True, through block_tables
    and seq_lens). exact (paged fp8 caches only): (exact_key_cache, exact_value_cache float16
    `[num_exact_blocks, block_size, Hkv, D]`, exact_block_tables int32 `[num_seqs, 1 + R]`,
    exact_window), read by `_paged_prefill_exact_kernel`. Returns (out `[total_q, H, D]`, lse float32
    `[H, total_q]`, or out itself as a placeholder without return_lse)."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[-2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = empty_like(q) if q.is_contiguous() else empty(q.shape, q.dtype, q.device)
    lse = empty((num_heads, total_q), torch.float32, q.device) if return_lse else out
    if total_q == 0 or num_seqs == 0:
        return out, lse
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    if paged:
        strides_k = (k.stride(0), k.stride(1), k.stride(2))
        strides_v = (v.stride(0), v.stride(1), v.stride(2))
        page_size = k.shape[1]
    else:
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        strides_k = (0, k.stride(0), k.stride(1))
        strides_v = (0, v.stride(0), v.stride(1))
        page_size = 1
    has_scale = k.dtype in FP8_DTYPES
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    args = (
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_q if paged else cu_seqlens_k,
        seq_lens if paged else cu_seqlens_q, block_tables if paged else cu_seqlens_q,
        k_scale.float() if has_scale else q, v_scale.float() if has_scale else q, q.stride(0), q.stride(1),
        *strides_k, *strides_v, out.stride(0), out.stride(1), lse.stride(0) if return_lse else 0,
        block_tables.stride(0) if paged else 0, k.shape[0] if paged else 1,
        block_tables.shape[1] if paged else 0, num_heads // num_kv_heads,
        head_dim**-0.5 if scale is None else scale, float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0,
    )  # fmt: skip
    constexprs = dict(
        HEAD_DIM=head_dim, PAGED=paged, PAGE_SIZE=page_size, CAUSAL=causal,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_KV_SCALE=has_scale,
        RETURN_LSE=return_lse, IEEE=q.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=config.get("num_warps", 4),
        num_stages=config.get("num_stages", 2),
    )  # fmt: skip
    if exact is None:
        _prefill_kernel[grid](*args, **constexprs)
    else:
        _paged_prefill_exact_kernel[grid](*args, *exact_kernel_args(*exact), **constexprs)
    return out, lse
