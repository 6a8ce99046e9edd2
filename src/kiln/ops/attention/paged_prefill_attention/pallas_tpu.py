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

An fp8 cache's exact positions are read as in paged_decode_attention's kernel: exact_block_tables
scalar-prefetched, the exact caches two more page operands whose index map names the exact block of
a logical page (column 0 for page 0, the ring column for a page holding window positions, and for a
page without exact slots a block the query block's range fetches anyway: no copy), the exact values
taken over the fp8 ones at the exact slots before the scale. The window follows the context's end,
so the exact slots are the same for every query block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.attention.jax_common import (
    kv_block_range,
    paged_page_update,
    paged_tpu_operands,
    paged_tpu_refs,
    physical_page,
    reset_softmax_state,
    softmax_scratch,
    static_options,
    to_padded,
    token_rows,
    visible_mask,
    write_softmax_out,
)
from kiln.ops.attention.jax_exact import exact_page_rows, exact_physical_page, ring_size, static_exact_window
from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION
from kiln.ops.pallas_common import round_up, squeezed, tpu_interpret, tpu_params


def _kernel(
    block_tables_ref, seq_lens_ref, q_lens_ref, *refs, scale, window, softcap, block_q, block_size, group,
    quantized, exact, exact_window,
):  # fmt: skip
    scale_refs, q_ref, k_ref, v_ref, exact_refs, o_ref, state = paged_tpu_refs(refs, quantized, exact)
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len, q_len = seq_lens_ref[b], q_lens_ref[b]

    @pl.when(j == 0)
    def _():
        reset_softmax_state(*state)

    first, last = kv_block_range(i, block_q, block_size, q_len, seq_len, True, window)

    @pl.when((j >= first) & (j <= last) & (i * block_q < q_len))
    def _():
        shape = (block_q * group, block_size)
        rows = i * block_q + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, shape, 0), jnp.int32(group))
        cols = j * block_size + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        visible = visible_mask(rows, cols, seq_len - q_len, seq_len, True, window) & (rows < q_len)
        exact_page = None
        if exact:
            exact_page = (*exact_refs, exact_page_rows(j, seq_len, block_size, exact_window))
        paged_page_update(
            j, seq_len, visible, q_ref, k_ref, v_ref, scale_refs, state, scale=scale, softcap=softcap,
            exact=exact_page,
        )  # fmt: skip

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        write_softmax_out(o_ref, state)


@functools.partial(
    jax.jit,
    static_argnames=("max_seqlen_q", "scale", "window", "softcap", "exact_window", "block_q", "interpret"),
)
def _paged_prefill_tpu(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, exact_key_cache,
    exact_value_cache, exact_block_tables, max_seqlen_q, scale, window, softcap, exact_window, block_q,
    interpret,
):  # fmt: skip
    total_q, heads, head_dim = q.shape
    batch, max_blocks = block_tables.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    # block_q * group query rows per tile: a sublane multiple, about 256 rows at most.
    block_q = block_q or min(round_up(max(max_seqlen_q, 1), 8), max(8, 256 // group // 8 * 8))
    seq_q = round_up(max(max_seqlen_q, 1), block_q)
    cu_seqlens_q = cu_seqlens_q.astype(jnp.int32)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    padded = to_padded(q, cu_seqlens_q, seq_q)  # [B, Sq, H, D]
    padded = padded.reshape(batch, seq_q, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    padded = padded.reshape(batch, kv_heads, seq_q * group, head_dim)

    exact = exact_block_tables is not None
    ring = ring_size(exact_block_tables, exact_window) if exact else 0

    def page_index(b, i, j, block_tables_ref, seq_lens_ref, q_lens_ref, *_):
        pages = kv_block_range(i, block_q, block_size, q_lens_ref[b], seq_lens_ref[b], True, window)
        return physical_page(block_tables_ref, b, j, *pages)

    def exact_page_index(b, i, j, block_tables_ref, seq_lens_ref, q_lens_ref, exact_tables_ref):
        seq_len = seq_lens_ref[b]
        first, last = kv_block_range(i, block_q, block_size, q_lens_ref[b], seq_len, True, window)
        return exact_physical_page(
            exact_tables_ref, b, j, first, last, seq_len, block_size, exact_window, ring
        )

    q_spec = pl.BlockSpec((squeezed(), kv_heads, block_q * group, head_dim), lambda b, i, j, *_: (b, 0, i, 0))
    page_spec = pl.BlockSpec((squeezed(), block_size, kv_heads, head_dim), page_index)
    exact_spec = pl.BlockSpec((squeezed(), block_size, kv_heads, head_dim), exact_page_index)
    in_specs, operands = paged_tpu_operands(
        padded, q_spec, page_spec, key_cache, value_cache, k_scale, v_scale, exact_spec,
        (exact_key_cache, exact_value_cache) if exact else (),
    )  # fmt: skip
    prefetch = [block_tables, seq_lens.astype(jnp.int32), q_lens]
    prefetch += [exact_block_tables] if exact else []
    kernel = functools.partial(
        _kernel, scale=scale, window=window, softcap=softcap, block_q=block_q, block_size=block_size,
        group=group, quantized=k_scale is not None, exact=exact, exact_window=exact_window,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(batch, seq_q // block_q, max_blocks),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=softmax_scratch((kv_heads,), block_q * group, head_dim),
        ),
        out_shape=jax.ShapeDtypeStruct(padded.shape, q.dtype),
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(*prefetch, *operands)
    out = out.reshape(batch, kv_heads, seq_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(batch, seq_q, heads, head_dim)
    seq, pos = token_rows(cu_seqlens_q, total_q)
    return out[seq, pos]


def paged_prefill_attention_pallas_tpu(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale=None,
    sliding_window=None, softcap=None, k_scale=None, v_scale=None, exact_key_cache=None,
    exact_value_cache=None, exact_block_tables=None, exact_window=0, *, block_q=None, interpret=None,
):  # fmt: skip
    """q [total_q, H, D] (each sequence's last q_len tokens) over the paged cache -> [total_q, H, D];
    the Mosaic TPU kernel (interpreted off-TPU)."""
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    interpret = tpu_interpret() if interpret is None else interpret
    return _paged_prefill_tpu(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, exact_key_cache,
        exact_value_cache, exact_block_tables, max_seqlen_q=int(max_seqlen_q), scale=scale, window=window,
        softcap=softcap, exact_window=static_exact_window(exact_block_tables, exact_window),
        block_q=block_q, interpret=interpret,
    )  # fmt: skip


PAGED_PREFILL_ATTENTION.register_jax("pallas_tpu", paged_prefill_attention_pallas_tpu)
