"""paged_decode_attention as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU); the op's
arguments and math are in spec.py (q [B, H, D] over the paged cache -> [B, H, D]).

Grid (B, max_blocks_per_seq), the page axis innermost ("arbitrary"). block_tables and seq_lens are
scalar-prefetched into SMEM, so the K/V index maps look up the physical page of logical page i
directly: the DMA engine gathers the pages, no gather pass over the cache. Logical pages past the
sequence (or before its window) clamp to the last (first) visible one, so Pallas sees an unchanged
block index and issues no copy, and their compute is skipped. A page block is [block_size, Hkv, D]
(its last two dims whole, as Mosaic wants); the query is reshaped to [Hkv, group, D] so each kv head
meets its query group as one aligned tile. m, l and acc live in VMEM scratch across pages.

An fp8 cache's exact positions: exact_block_tables is scalar-prefetched too, and the exact caches are
two more page operands whose index map names the exact block a logical page needs (page 0: column 0;
a page holding window positions: its ring column). A page without exact slots keeps a block an
earlier or later step of the sequence fetches anyway, so it costs no copy (jax_common.
exact_physical_page). In the kernel the exact values replace the fp8 ones at the exact slots
(jnp.where), before the scale: they are in the fp8 cache's units.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.attention.jax_common import (
    decode_page_range,
    over_paged_decode,
    paged_page_update,
    paged_tpu_operands,
    paged_tpu_refs,
    physical_page,
    reset_softmax_state,
    softmax_scratch,
    write_softmax_out,
)
from kiln.ops.attention.jax_exact import exact_page_rows, exact_physical_page, ring_size
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION
from kiln.ops.pallas_common import squeezed, tpu_interpret, tpu_params


def _kernel(
    block_tables_ref, seq_lens_ref, *refs, scale, window, softcap, block_size, quantized, exact, exact_window
):  # fmt: skip
    scale_refs, q_ref, k_ref, v_ref, exact_refs, o_ref, state = paged_tpu_refs(refs, quantized, exact)
    b, i = pl.program_id(0), pl.program_id(1)
    seq_len = seq_lens_ref[b]

    @pl.when(i == 0)
    def _():
        reset_softmax_state(*state)

    first, last = decode_page_range(seq_len, block_size, window)

    @pl.when((i >= first) & (i <= last))
    def _():
        cols = i * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        visible = cols < seq_len
        if window is not None:
            visible &= (seq_len - 1) - cols < window
        exact_page = None
        if exact:
            exact_page = (*exact_refs, exact_page_rows(i, seq_len, block_size, exact_window))
        paged_page_update(
            i, seq_len, visible, q_ref, k_ref, v_ref, scale_refs, state, scale=scale, softcap=softcap,
            exact=exact_page,
        )  # fmt: skip

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        write_softmax_out(o_ref, state)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "exact_window", "interpret"))
def _paged_decode_tpu(
    q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, exact_key_cache, exact_value_cache,
    exact_block_tables, scale, window, softcap, exact_window, interpret,
):  # fmt: skip
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    exact = exact_block_tables is not None
    ring = ring_size(exact_block_tables, exact_window) if exact else 0

    def page_index(b, i, block_tables_ref, seq_lens_ref, *_):
        return physical_page(block_tables_ref, b, i, *decode_page_range(seq_lens_ref[b], block_size, window))

    def exact_page_index(b, i, block_tables_ref, seq_lens_ref, exact_tables_ref):
        seq_len = seq_lens_ref[b]
        first, last = decode_page_range(seq_len, block_size, window)
        return exact_physical_page(
            exact_tables_ref, b, i, first, last, seq_len, block_size, exact_window, ring
        )

    q_spec = pl.BlockSpec((squeezed(), kv_heads, group, head_dim), lambda b, i, *_: (b, 0, 0, 0))
    page_spec = pl.BlockSpec((squeezed(), block_size, kv_heads, head_dim), page_index)
    exact_spec = pl.BlockSpec((squeezed(), block_size, kv_heads, head_dim), exact_page_index)
    qg = q.reshape(batch, kv_heads, group, head_dim)
    in_specs, operands = paged_tpu_operands(
        qg, q_spec, page_spec, key_cache, value_cache, k_scale, v_scale, exact_spec,
        (exact_key_cache, exact_value_cache) if exact else (),
    )  # fmt: skip
    prefetch = [block_tables, seq_lens] + ([exact_block_tables] if exact else [])
    kernel = functools.partial(
        _kernel, scale=scale, window=window, softcap=softcap, block_size=block_size,
        quantized=k_scale is not None, exact=exact, exact_window=exact_window,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(batch, block_tables.shape[1]),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=softmax_scratch((kv_heads,), group, head_dim),
        ),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), q.dtype),
        compiler_params=tpu_params("parallel", "arbitrary"),
        interpret=interpret,
    )(*prefetch, *operands)
    return out.reshape(batch, heads, head_dim)


# q [B, H, D] over the paged cache -> [B, H, D]; interpreted off the kernel's hardware.
paged_decode_attention_pallas_tpu = over_paged_decode(_paged_decode_tpu, tpu_interpret)

PAGED_DECODE_ATTENTION.register_jax("pallas_tpu", paged_decode_attention_pallas_tpu)
