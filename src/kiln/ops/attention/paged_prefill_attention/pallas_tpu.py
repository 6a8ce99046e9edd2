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
from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION
from kiln.ops.pallas_common import round_up, squeezed, tpu_interpret, tpu_params


def _kernel(
    block_tables_ref, seq_lens_ref, q_lens_ref, *refs, scale, window, softcap, block_q, block_size, group,
    quantized,
):  # fmt: skip
    scale_refs, q_ref, k_ref, v_ref, o_ref, state = paged_tpu_refs(refs, quantized)
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
        paged_page_update(
            j, seq_len, visible, q_ref, k_ref, v_ref, scale_refs, state, scale=scale, softcap=softcap
        )

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        write_softmax_out(o_ref, state)


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
    # block_q * group query rows per tile: a sublane multiple, about 256 rows at most.
    block_q = block_q or min(round_up(max(max_seqlen_q, 1), 8), max(8, 256 // group // 8 * 8))
    seq_q = round_up(max(max_seqlen_q, 1), block_q)
    cu_seqlens_q = cu_seqlens_q.astype(jnp.int32)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    padded = to_padded(q, cu_seqlens_q, seq_q)  # [B, Sq, H, D]
    padded = padded.reshape(batch, seq_q, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    padded = padded.reshape(batch, kv_heads, seq_q * group, head_dim)

    def page_index(b, i, j, block_tables_ref, seq_lens_ref, q_lens_ref):
        pages = kv_block_range(i, block_q, block_size, q_lens_ref[b], seq_lens_ref[b], True, window)
        return physical_page(block_tables_ref, b, j, *pages)

    q_spec = pl.BlockSpec((squeezed(), kv_heads, block_q * group, head_dim), lambda b, i, j, *_: (b, 0, i, 0))
    page_spec = pl.BlockSpec((squeezed(), block_size, kv_heads, head_dim), page_index)
    in_specs, operands = paged_tpu_operands(
        padded, q_spec, page_spec, key_cache, value_cache, k_scale, v_scale
    )
    kernel = functools.partial(
        _kernel, scale=scale, window=window, softcap=softcap, block_q=block_q, block_size=block_size,
        group=group, quantized=k_scale is not None,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, seq_q // block_q, max_blocks),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=softmax_scratch((kv_heads,), block_q * group, head_dim),
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
