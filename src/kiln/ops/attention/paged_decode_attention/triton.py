"""Triton flash-decoding for paged_decode_attention (arguments and math in spec.py).

Split-K: each sequence's context is cut into partitions of `partition_size` tokens (a multiple of
the page size and of BLOCK_N). Grid = sequences x kv heads x partitions; one program owns all the
query heads of one GQA group (padded to BLOCK_G >= 16 rows for tl.dot), so every KV page is read
from memory exactly once, and walks its partition BLOCK_N tokens at a time through the block table
(fp8 pages are converted to the query dtype in registers, their scales folded into the score and
output scaling). It writes a partial output normalized by its own softmax sum plus that sum's
log2 (the partial's log-sum-exp); a second kernel combines the partitions of each (sequence, head).
With a single partition the first kernel writes the final output directly.

Exact positions (an fp8 cache with exact caches, spec.py): `_decode_partition_exact_kernel` runs the
same program with HAS_EXACT. A tile holding some of the sequence's first block or its last
exact_window positions takes those keys and values from the float16 exact caches after converting
the fp8 tile, before the folded scales apply (the exact values are in the fp8 cache's units;
triton_exact.overlay_exact_tile); every other tile skips that with one scalar branch and reads
only the fp8 cache. Launches without exact caches use `_decode_partition_kernel`, with its signature
and its compiled code as before: HAS_EXACT is False there and none of that code exists.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from kiln.ops.alloc import empty, empty_like
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION, paged_decode_tune_shape
from kiln.ops.attention.triton_exact import exact_kernel_args, overlay_exact_tile, tile_has_exact
from kiln.ops.attention.validate import FP8_DTYPES
from kiln.ops.registry import Implementation, triton_available, triton_interpreting
from kiln.ops.tuned_configs import lookup

MAX_SPLITS = 64


@triton.jit
def _decode_partition(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    part_out_ptr, part_lse_ptr, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_bt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    num_blocks, table_width, num_queries_per_kv, sm_scale, softcap, window, partition_size, exact_k_ptr,
    exact_v_ptr, exact_tables_ptr, stride_ekb, stride_ekt, stride_ekh, stride_evb, stride_evt, stride_evh,
    stride_et, num_exact_blocks, exact_ring, exact_window, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KV_SCALE: tl.constexpr, HAS_EXACT: tl.constexpr,
    IEEE: tl.constexpr, SINGLE_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program of both partition kernels below (inlined into each): one partition of one sequence
    for the query heads of one kv head. HAS_EXACT (fp8 cache): exact caches [num_exact_blocks,
    PAGE_SIZE, Hkv, D] and their table [num_seqs, 1 + R] (exact_ring = max(R, 1))."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq), table_width * PAGE_SIZE)  # never past the table row
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)
    if HAS_WINDOW:  # tiles wholly before the window are never loaded
        start = tl.maximum(start, tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * num_queries_per_kv + offs_g
    row_mask = (offs_g[:, None] < num_queries_per_kv) & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    qk_scale = sm_scale
    if HAS_KV_SCALE:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    if not HAS_SOFTCAP:
        qk_scale = qk_scale * 1.4426950408889634  # base 2 for exp2

    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    exact_row = exact_tables_ptr + seq.to(tl.int64) * stride_et
    exact_k_head = exact_k_ptr + kv_head.to(tl.int64) * stride_ekh
    exact_v_head = exact_v_ptr + kv_head.to(tl.int64) * stride_evh
    exact_window_start = seq_len - exact_window
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        in_range = offs_n < end
        block = tl.load(table + offs_n // PAGE_SIZE, mask=in_range, other=0)
        # Unchecked tables (kiln.ops.trusted_inputs) may hold entries outside the cache: clamped, a bad
        # entry gives wrong values for its own sequence but never a read outside the cache.
        block = tl.minimum(tl.maximum(block, 0), num_blocks - 1).to(tl.int64)
        kv_mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(
            k_head + block[:, None] * stride_kb + (offs_n % PAGE_SIZE)[:, None] * stride_kt + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        v = tl.load(
            v_head + block[:, None] * stride_vb + (offs_n % PAGE_SIZE)[:, None] * stride_vt + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)
        if HAS_EXACT:
            if tile_has_exact(tile, tl.minimum(tile + BLOCK_N, end), exact_window_start, PAGE_SIZE):
                k = overlay_exact_tile(
                    k, offs_n, offs_d, in_range, exact_window_start, exact_row, exact_k_head, stride_ekb,
                    stride_ekt, num_exact_blocks, exact_ring, HEAD_DIM, PAGE_SIZE,
                )  # fmt: skip
                v = overlay_exact_tile(
                    v, offs_n, offs_d, in_range, exact_window_start, exact_row, exact_v_head, stride_evb,
                    stride_evt, num_exact_blocks, exact_ring, HEAD_DIM, PAGE_SIZE,
                )  # fmt: skip
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP:  # softcap * tanh(x / softcap) with tanh(y) = 1 - 2 / (e^{2y} + 1), in base 2
            y = s * qk_scale / softcap
            s = (softcap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp2(y * 2.8853900817779268) + 1.0))
        else:
            s = s * qk_scale
        visible = in_range
        if HAS_WINDOW:
            visible = visible & (offs_n > seq_len - 1 - window)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: avoid -inf - -inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if HAS_KV_SCALE:
        out = out * tl.load(v_scale_ptr + kv_head)
    if SINGLE_SPLIT:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )
    else:
        # An empty partition (past seq_len or before the window) stores lse -inf: weight 0 below.
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        part = part_out_ptr + seq.to(tl.int64) * stride_pb + split * stride_ps
        tl.store(part + heads[:, None] * stride_ph + offs_d[None, :], out, mask=row_mask)
        tl.store(
            part_lse_ptr + seq.to(tl.int64) * stride_lb + heads * stride_lh + split,
            lse,
            mask=offs_g < num_queries_per_kv,
        )


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    part_out_ptr, part_lse_ptr, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_bt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    num_blocks, table_width, num_queries_per_kv, sm_scale, softcap, window, partition_size,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_KV_SCALE: tl.constexpr, IEEE: tl.constexpr, SINGLE_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Without exact positions (the exact arguments are placeholders HAS_EXACT=False never reads)."""
    _decode_partition(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
        part_out_ptr, part_lse_ptr, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb,
        stride_vt, stride_vh, stride_bt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
        stride_lh, num_blocks, table_width, num_queries_per_kv, sm_scale, softcap, window, partition_size,
        k_cache_ptr, v_cache_ptr, block_tables_ptr, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, HEAD_DIM, PAGE_SIZE,
        HAS_WINDOW, HAS_SOFTCAP, HAS_KV_SCALE, False, IEEE, SINGLE_SPLIT, BLOCK_G, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _decode_partition_exact_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    part_out_ptr, part_lse_ptr, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
    stride_vh, stride_bt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    num_blocks, table_width, num_queries_per_kv, sm_scale, softcap, window, partition_size, exact_k_ptr,
    exact_v_ptr, exact_tables_ptr, stride_ekb, stride_ekt, stride_ekh, stride_evb, stride_evt, stride_evh,
    stride_et, num_exact_blocks, exact_ring, exact_window, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KV_SCALE: tl.constexpr, IEEE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """An fp8 cache with exact positions (HAS_KV_SCALE)."""
    _decode_partition(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
        part_out_ptr, part_lse_ptr, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb,
        stride_vt, stride_vh, stride_bt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
        stride_lh, num_blocks, table_width, num_queries_per_kv, sm_scale, softcap, window, partition_size,
        exact_k_ptr, exact_v_ptr, exact_tables_ptr, stride_ekb, stride_ekt, stride_ekh, stride_evb,
        stride_evt, stride_evh, stride_et, num_exact_blocks, exact_ring, exact_window, HEAD_DIM, PAGE_SIZE,
        HAS_WINDOW, HAS_SOFTCAP, HAS_KV_SCALE, True, IEEE, SINGLE_SPLIT, BLOCK_G, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
    stride_oh, num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out = sum_s 2^(lse_s - max) * out_s / sum_s 2^(lse_s - max), one program per (sequence, head)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(
        part_lse_ptr + seq * stride_lb + head * stride_lh + offs_s,
        mask=offs_s < num_splits,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    mask = (offs_s[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM)
    parts = tl.load(
        part_out_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask,
        other=0.0,
    )
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_configs(shape: dict, dtype: torch.dtype) -> list[dict]:
    """The `kiln tune` search space (partition_size None = the occupancy heuristic)."""
    configs = []
    for block_n, warps, stages, partition in itertools.product(
        (32, 64, 128), (4, 8), (2, 3, 4), (None, 256, 512, 1024, 2048)
    ):
        if shape["head_dim"] > 128 and block_n > 64:
            continue
        configs.append(
            {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "partition_size": partition}
        )
    return configs


def _heuristic_config(head_dim: int) -> dict:
    if triton_interpreting():  # small partitions so test contexts exercise the split + combine path
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "partition_size": 32}
    return {"BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 4, "num_stages": 3, "partition_size": None}


def _partition_size(
    num_seqs: int, num_kv_heads: int, capacity: int, granule: int, device: torch.device
) -> int:
    """Enough partitions that sequences x kv heads x partitions fills the GPU about twice (batch 1 with a
    long context needs many splits; a big batch needs none), at least 256 tokens each, at most MAX_SPLITS."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 132
    splits = min(
        MAX_SPLITS, max(1, triton.cdiv(2 * sms, num_seqs * num_kv_heads)), triton.cdiv(capacity, 256)
    )
    return triton.cdiv(triton.cdiv(capacity, max(splits, 1)), granule) * granule


def paged_decode_attention_triton(
    q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
    k_scale=None, v_scale=None, exact_key_cache=None, exact_value_cache=None, exact_block_tables=None,
    exact_window=0, config=None,
):  # fmt: skip
    num_seqs, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    if config is None:
        config = lookup(
            "paged_decode_attention", q.dtype, paged_decode_tune_shape(q, key_cache, block_tables)
        )
        config = config or _heuristic_config(head_dim)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = empty_like(q) if q.is_contiguous() else empty(q.shape, q.dtype, q.device)
    if num_seqs == 0:
        return out
    block_n = config["BLOCK_N"]
    granule = max(block_n, page_size)  # both powers of two: partitions hold whole pages and whole tiles
    capacity = block_tables.shape[1] * page_size
    partition = config.get("partition_size")
    if partition is None:
        partition = _partition_size(num_seqs, num_kv_heads, capacity, granule, q.device)
    # At most MAX_SPLITS partitions whatever the config says: the combine kernel holds them all in registers.
    partition = triton.cdiv(max(partition, triton.cdiv(capacity, MAX_SPLITS)), granule) * granule
    num_splits = triton.cdiv(capacity, partition)
    group = num_heads // num_kv_heads
    has_scale = key_cache.dtype in FP8_DTYPES
    single = num_splits == 1
    if single:
        part_out = part_lse = out
        part_strides = (0, 0, 0, 0, 0)
    else:
        part_out = empty((num_seqs, num_heads, num_splits, head_dim), torch.float32, q.device)
        part_lse = empty((num_seqs, num_heads, num_splits), torch.float32, q.device)
        part_strides = (
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
        )
    block_d = max(16, triton.next_power_of_2(head_dim))
    args = (
        q, key_cache, value_cache, block_tables, seq_lens, k_scale.float() if has_scale else q,
        v_scale.float() if has_scale else q, out, part_out, part_lse, q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
        value_cache.stride(1), value_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        *part_strides, key_cache.shape[0], block_tables.shape[1], group,
        head_dim**-0.5 if scale is None else scale, float(softcap) if softcap is not None else 1.0,
        int(sliding_window) if sliding_window is not None else 0, partition,
    )  # fmt: skip
    constexprs = dict(
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, HAS_KV_SCALE=has_scale, IEEE=q.dtype == torch.float32,
        SINGLE_SPLIT=single, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2),
    )  # fmt: skip
    grid = (num_seqs, num_kv_heads, num_splits)
    if exact_block_tables is None:
        _decode_partition_kernel[grid](*args, **constexprs)
    else:
        exact = exact_kernel_args(exact_key_cache, exact_value_cache, exact_block_tables, exact_window)
        _decode_partition_exact_kernel[grid](*args, *exact, **constexprs)
    if not single:
        _decode_combine_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, *part_strides, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out


PAGED_DECODE_ATTENTION.register(
    Implementation("triton", paged_decode_attention_triton, triton_available, configs=decode_configs)
)
