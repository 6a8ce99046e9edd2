"""paged_prefill_attention as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU); the op's
arguments and math are in spec.py (varlen q [total_q, H, D] over the paged cache -> [total_q, H, D]).

The queries are gathered into a padded batch first (XLA), laid out per kv head as
[B, Hkv, Sq * group, D] (row r = query r // group, head member r % group), so each kv head meets its
whole query group as one [block_q * group, D] tile. Grid (B, query blocks, max_blocks_per_seq), the
page axis innermost ("arbitrary"). As in paged_decode_attention's kernel, block_tables, seq_lens and
the query lengths are scalar-prefetched into SMEM and the K/V index maps look up the physical page
directly (the DMA engine gathers the pages); logical pages outside the ones a query block can see
(causal bottom-right, sliding window) clamp to the nearest visible one, so Pallas issues no copy,
and their compute is skipped. m, l and acc live in VMEM scratch across pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.attention.jax_common import (
    NEG_INF,
    dot_precision,
    finish_softmax,
    online_softmax_update,
    static_options,
    to_padded,
    token_rows,
    visible_mask,
)
from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION
from kiln.ops.pallas_common import round_up, squeezed, tpu_interpret, tpu_params


def _page_range(i, block_q, q_len, seq_len, block_size, window):
    """(first, last) logical page holding a key that query block i can see (queries are the last
    q_len of seq_len positions: query r sits at position r + seq_len - q_len)."""
    offset = seq_len - q_len
    last_key = jnp.minimum(seq_len - 1, i * block_q + block_q - 1 + offset)
    last = jax.lax.div(jnp.maximum(last_key, 0), jnp.int32(block_size))
    if window is None:
        return jnp.int32(0), last
    first_key = jnp.maximum(i * block_q + offset - window + 1, 0)
    return jax.lax.div(first_key, jnp.int32(block_size)), last


def _kernel(
    block_tables_ref, seq_lens_ref, q_lens_ref, *refs,
    scale, window, softcap, block_q, block_size, kv_heads, group, quantized,
):  # fmt: skip
    if quantized:
        k_scale_ref, v_scale_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref = refs
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len, q_len = seq_lens_ref[b], q_lens_ref[b]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, NEG_INF)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    first, last = _page_range(i, block_q, q_len, seq_len, block_size, window)

    @pl.when((j >= first) & (j <= last) & (i * block_q < q_len))
    def _():
        precision = dot_precision(q_ref.dtype)
        shape = (block_q * group, block_size)
        rows = i * block_q + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, shape, 0), jnp.int32(group))
        cols = j * block_size + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        visible = visible_mask(rows, cols, seq_len - q_len, seq_len, True, window) & (rows < q_len)
        # Slots of the last page past seq_len are never read by contract (NaN there must not leak
        # through probability 0 times value): their values are zeroed; their scores are masked.
        read = (j * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)) < seq_len
        for g in range(kv_heads):  # static: each kv head against its query group
            q = q_ref[g]  # [block_q * group, D]
            k, v = k_ref[:, g, :], v_ref[:, g, :]  # [block_size, D]
            if quantized:
                k = (k.astype(jnp.float32) * k_scale_ref[g]).astype(q.dtype)
                v = (v.astype(jnp.float32) * v_scale_ref[g]).astype(q.dtype)
            v = jnp.where(read, v, jnp.zeros((), v.dtype))
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
            )
            s = s * scale
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            s = jnp.where(visible, s, NEG_INF)
            m, l_, acc = online_softmax_update(s, v, m_ref[g], l_ref[g], acc_ref[g], precision)
            m_ref[g], l_ref[g], acc_ref[g] = m, l_, acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        out, _ = finish_softmax(m_ref[...], l_ref[...], acc_ref[...])
        o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("max_seqlen_q", "scale", "window", "softcap", "block_q", "interpret")
)
def _paged_prefill_tpu(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, max_seqlen_q,
    scale, window, softcap, block_q, interpret,
):  # fmt: skip
    total_q, heads, head_dim = q.shape
    batch, max_blocks = block_tables.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    quantized = k_scale is not None
    # block_q * group query rows per tile: a sublane multiple, about 256 rows at most.
    block_q = block_q or min(round_up(max(max_seqlen_q, 1), 8), max(8, 256 // group // 8 * 8))
    seq_q = round_up(max(max_seqlen_q, 1), block_q)
    cu_seqlens_q = cu_seqlens_q.astype(jnp.int32)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    padded = to_padded(q, cu_seqlens_q, seq_q)  # [B, Sq, H, D]
    padded = padded.reshape(batch, seq_q, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    padded = padded.reshape(batch, kv_heads, seq_q * group, head_dim)

    def page_index(b, i, j, block_tables_ref, seq_lens_ref, q_lens_ref):
        first, last = _page_range(i, block_q, q_lens_ref[b], seq_lens_ref[b], block_size, window)
        # max(.., 0): an empty sequence still names a real page (its compute is skipped).
        return jnp.maximum(block_tables_ref[b, jnp.clip(j, first, last)], 0), 0, 0, 0

    q_spec = pl.BlockSpec((squeezed(), kv_heads, block_q * group, head_dim), lambda b, i, j, *_: (b, 0, i, 0))
    page_spec = pl.BlockSpec((squeezed(), block_size, kv_heads, head_dim), page_index)
    in_specs, operands = [q_spec, page_spec, page_spec], [padded, key_cache, value_cache]
    if quantized:
        smem = pl.BlockSpec(memory_space=pltpu.SMEM)
        in_specs = [smem, smem, *in_specs]
        operands = [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), *operands]
    kernel = functools.partial(
        _kernel, scale=scale, window=window, softcap=softcap, block_q=block_q, block_size=block_size,
        kv_heads=kv_heads, group=group, quantized=quantized,
    )  # fmt: skip
    rows = block_q * group
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, seq_q // block_q, max_blocks),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((kv_heads, rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(padded.shape, q.dtype),
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(block_tables, seq_lens.astype(jnp.int32), q_lens, *operands)
    out = out.reshape(batch, kv_heads, seq_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(batch, seq_q, heads, head_dim)
    seq, pos = token_rows(cu_seqlens_q, total_q)
    return out[seq, pos]


def paged_prefill_attention_pallas_tpu(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale=None,
    sliding_window=None, softcap=None, k_scale=None, v_scale=None, *, block_q=None, interpret=None,
):  # fmt: skip
    """q [total_q, H, D] (each sequence's last q_len tokens) over the paged cache -> [total_q, H, D];
    the Mosaic TPU kernel (interpreted off-TPU)."""
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    interpret = tpu_interpret() if interpret is None else interpret
    return _paged_prefill_tpu(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale,
        max_seqlen_q=int(max_seqlen_q), scale=scale, window=window, softcap=softcap, block_q=block_q,
        interpret=interpret,
    )  # fmt: skip


PAGED_PREFILL_ATTENTION.register_jax("pallas_tpu", paged_prefill_attention_pallas_tpu)
