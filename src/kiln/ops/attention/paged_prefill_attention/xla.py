"""paged_prefill_attention in plain jax.numpy: gather every sequence's pages (padded to the block
table's width) and its queries (padded to max_seqlen_q), one masked attention over the padded batch
(kiln.ops.attention.jax_common; the queries are the last q_len positions: bottom-right causal), then
the varlen query rows gathered back. An fp8 cache's exact positions are taken from the exact caches
as the pages are gathered, before the scale."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.attention.jax_common import (
    attend_padded,
    gather_kv_pages,
    static_options,
    to_padded,
    token_rows,
)
from kiln.ops.attention.jax_exact import static_exact_window
from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "scale", "window", "softcap", "exact_window"))
def _paged_prefill_xla(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, exact_key_cache,
    exact_value_cache, exact_block_tables, max_seqlen_q, scale, window, softcap, exact_window,
):  # fmt: skip
    cu_seqlens_q, seq_lens = cu_seqlens_q.astype(jnp.int32), seq_lens.astype(jnp.int32)
    k, v = gather_kv_pages(
        key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, exact_key_cache, exact_value_cache,
        exact_block_tables, exact_window, q.dtype,
    )  # fmt: skip
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    padded_q = to_padded(q, cu_seqlens_q, max_seqlen_q)
    out, _ = attend_padded(padded_q, k, v, q_lens, seq_lens, scale, True, window, softcap)
    seq, pos = token_rows(cu_seqlens_q, q.shape[0])
    return out[seq, pos]


def paged_prefill_attention_xla(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale=None,
    sliding_window=None, softcap=None, k_scale=None, v_scale=None, exact_key_cache=None,
    exact_value_cache=None, exact_block_tables=None, exact_window=0,
):  # fmt: skip
    """q [total_q, H, D] (each sequence's last q_len tokens) over the paged cache -> [total_q, H, D]."""
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    return _paged_prefill_xla(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, exact_key_cache,
        exact_value_cache, exact_block_tables, max_seqlen_q=int(max_seqlen_q), scale=scale, window=window,
        softcap=softcap, exact_window=static_exact_window(exact_block_tables, exact_window),
    )  # fmt: skip


PAGED_PREFILL_ATTENTION.register_jax("xla", paged_prefill_attention_xla)
