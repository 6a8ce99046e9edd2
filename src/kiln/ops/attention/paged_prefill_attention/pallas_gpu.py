"""paged_prefill_attention as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU); the op's
arguments and math are in spec.py (varlen q [total_q, H, D] over the paged cache -> [total_q, H, D]).

The queries are gathered into a padded batch first (XLA) and laid out per kv head as
[B, Hkv, Sq * Gp, D] (row r = query r // Gp, head member r % Gp, the group padded to a power of two
Gp), so each kv head meets its whole query group as one [block_q * Gp, D] tile, as in pallas_tpu.py.
Grid (B, Hkv, query blocks): a program walks the logical pages its query block can see (causal
bottom-right, sliding window; kiln.ops.attention.jax_common.kv_block_range) with fori_loop, reading
each physical page through the block table (whole-array refs, pages loaded by index, as in
paged_decode_attention's GPU kernel), with an online softmax in float32. fp8 pages are widened and
scaled in float32, then rounded to the queries' dtype for the dots. An fp8 cache's exact positions
(whole-array exact_block_tables and exact caches) are read as in paged_decode_attention's GPU
kernel: each page's exact slots loaded under a row mask from the exact block its table names, taken
over the fp8 values before the scale; the window follows the context's end, the same for every query.

Triton's dots want every dim >= 16: pages of 16 slots or more go through tl.dot; smaller pages
(block_size 8 and below) use broadcast-multiply-sums instead. head_dim is zero-padded to a power of
two (free for 64/128, a copy of the cache for other sizes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.attention.jax_common import (
    NEG_INF,
    dot_precision,
    finish_softmax,
    kv_block_range,
    online_softmax_update,
    scores,
    static_options,
    to_padded,
    token_rows,
    visible_mask,
)
from kiln.ops.attention.jax_exact import exact_window_page, gpu_exact_overlay, ring_size, static_exact_window
from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up, squeezed

MIN_DOT = 16  # Triton's smallest tl.dot dimension
TILE_ROWS = 64  # query rows (block_q * Gp) per program


def _small_page_update(s, v, m, l_, acc):
    """online_softmax_update for a page under MIN_DOT slots: P V as a broadcast-multiply-sum."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing visible yet: no -inf - -inf
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m - m_safe)
    pv = jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)
    return m_new, alpha * l_ + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def _gpu_kernel(
    block_tables_ref, seq_lens_ref, q_lens_ref, *refs, scale, window, softcap, block_q, group_rows,
    block_size, quantized, exact, exact_window, ring,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    if quantized:
        k_scale_ref, v_scale_ref, *refs = refs
    q_ref, k_ref, v_ref, *refs = refs
    exact_refs, (o_ref,) = (refs[:3], refs[3:]) if exact else (None, refs)
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len, q_len = seq_lens_ref[b], q_lens_ref[b]
    q = q_ref[...]  # [block_q * Gp, D]
    rows, width = q.shape
    precision = dot_precision(q.dtype)
    query = i * block_q + jax.lax.div(
        jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 0), jnp.int32(group_rows)
    )
    page_rows = (pl.ds(0, block_size), h, pl.ds(0, width))
    window_page = exact_window_page(seq_len, block_size, exact_window) if exact else None

    def body(j, carry):
        page = jnp.maximum(block_tables_ref[b, j], 0)
        k = plgpu.load(k_ref.at[(page, *page_rows)])  # [block_size, D]
        v = plgpu.load(v_ref.at[(page, *page_rows)])
        if quantized or exact:
            k, v = k.astype(jnp.float32), v.astype(jnp.float32)
            if exact:
                k, v = gpu_exact_overlay(
                    k, v, exact_refs, b, j, page_rows, seq_len, window_page, window=exact_window, ring=ring
                )
            if quantized:
                k, v = k * k_scale_ref[h], v * v_scale_ref[h]
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        cols = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
        visible = visible_mask(query, cols, seq_len - q_len, seq_len, True, window) & (query < q_len)
        # Slots past seq_len are never read by contract (NaN there must not reach P V): zeroed.
        read = (j * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)) < seq_len
        v = jnp.where(read, v, jnp.zeros((), v.dtype))
        if block_size >= MIN_DOT:
            s = jnp.where(visible, scores(q, k, scale, softcap, precision), NEG_INF)
            return online_softmax_update(s, v, *carry, precision)
        s = jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=-1) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        return _small_page_update(jnp.where(visible, s, NEG_INF), v, *carry)

    init = (
        jnp.full((rows, 1), NEG_INF, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, width), jnp.float32),
    )
    first, last = kv_block_range(i, block_q, block_size, q_len, seq_len, True, window)
    last = jnp.where(i * block_q < q_len, last, first - 1)  # a query block past q_len reads no page
    m, l_, acc = jax.lax.fori_loop(first, last + 1, body, init)
    out, _ = finish_softmax(m, l_, acc)
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("max_seqlen_q", "scale", "window", "softcap", "exact_window", "block_q", "interpret"),
)
def _paged_prefill_gpu(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, exact_key_cache,
    exact_value_cache, exact_block_tables, max_seqlen_q, scale, window, softcap, exact_window, block_q,
    interpret,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    total_q, heads, head_dim = q.shape
    batch = block_tables.shape[0]
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    group_rows, width = pl.next_power_of_2(group), max(MIN_DOT, pl.next_power_of_2(head_dim))
    # block_q * Gp rows per tile: at least MIN_DOT (tl.dot), about TILE_ROWS.
    smallest, largest = max(1, MIN_DOT // group_rows), max(1, TILE_ROWS // group_rows)
    block_q = block_q or min(max(pl.next_power_of_2(max(max_seqlen_q, 1)), smallest), largest)
    seq_q = round_up(max(max_seqlen_q, 1), block_q)
    cu_seqlens_q = cu_seqlens_q.astype(jnp.int32)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    padded = to_padded(q, cu_seqlens_q, seq_q).reshape(batch, seq_q, kv_heads, group, head_dim)
    padded = pad_to(pad_to(padded, 3, group_rows), 4, width).transpose(0, 2, 1, 3, 4)
    padded = padded.reshape(batch, kv_heads, seq_q * group_rows, width)
    caches = [pad_to(c, 3, width) for c in (key_cache, value_cache)]

    whole = pl.no_block_spec  # block tables, lengths, scales and the caches: read by index
    q_spec = pl.BlockSpec((squeezed(), squeezed(), block_q * group_rows, width), lambda b, h, i: (b, h, i, 0))
    lengths = [block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), q_lens]
    operands = [*lengths, padded, *caches]
    if k_scale is not None:
        operands = [*lengths, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), padded, *caches]
    exact = exact_block_tables is not None
    if exact:
        operands += [exact_block_tables, *(pad_to(c, 3, width) for c in (exact_key_cache, exact_value_cache))]
    in_specs = [q_spec if op is padded else whole for op in operands]
    kernel = functools.partial(
        _gpu_kernel, scale=scale, window=window, softcap=softcap, block_q=block_q, group_rows=group_rows,
        block_size=block_size, quantized=k_scale is not None, exact=exact, exact_window=exact_window,
        ring=ring_size(exact_block_tables, exact_window) if exact else 0,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, seq_q // block_q),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(padded.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(*operands)
    out = out.reshape(batch, kv_heads, seq_q, group_rows, width)[:, :, :, :group, :head_dim]
    out = out.transpose(0, 2, 1, 3, 4).reshape(batch, seq_q, heads, head_dim)
    seq, pos = token_rows(cu_seqlens_q, total_q)
    return out[seq, pos]


def paged_prefill_attention_pallas_gpu(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale=None,
    sliding_window=None, softcap=None, k_scale=None, v_scale=None, exact_key_cache=None,
    exact_value_cache=None, exact_block_tables=None, exact_window=0, *, block_q=None, interpret=None,
):  # fmt: skip
    """q [total_q, H, D] (each sequence's last q_len tokens) over the paged cache -> [total_q, H, D];
    the Pallas Triton kernel (interpreted off-GPU). block_q: queries per tile (a power of two)."""
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    interpret = gpu_interpret() if interpret is None else interpret
    return _paged_prefill_gpu(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, exact_key_cache,
        exact_value_cache, exact_block_tables, max_seqlen_q=int(max_seqlen_q), scale=scale, window=window,
        softcap=softcap, exact_window=static_exact_window(exact_block_tables, exact_window),
        block_q=block_q, interpret=interpret,
    )  # fmt: skip


PAGED_PREFILL_ATTENTION.register_jax("pallas_gpu", paged_prefill_attention_pallas_gpu)
