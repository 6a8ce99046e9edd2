"""paged_prefill_attention in plain jax.numpy: gather every sequence's pages (padded to the block
table's width) and its queries (padded to max_seqlen_q), one masked attention over the padded batch
(kiln.ops.attention.jax_common; the queries are the last q_len positions: bottom-right causal), then
the varlen query rows gathered back."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.attention.jax_common import attend_padded, gather_pages, static_options, to_padded, token_rows
from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION


@functools.partial(jax.jit, static_argnames=("max_seqlen_q", "scale", "window", "softcap"))
def _paged_prefill_xla(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, max_seqlen_q,
    scale, window, softcap,
):  # fmt: skip
    cu_seqlens_q, seq_lens = cu_seqlens_q.astype(jnp.int32), seq_lens.astype(jnp.int32)
    k = gather_pages(key_cache, block_tables, seq_lens, k_scale, q.dtype)
    v = gather_pages(value_cache, block_tables, seq_lens, v_scale, q.dtype)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    padded_q = to_padded(q, cu_seqlens_q, max_seqlen_q)
    out, _ = attend_padded(padded_q, k, v, q_lens, seq_lens, scale, True, window, softcap)
    seq, pos = token_rows(cu_seqlens_q, q.shape[0])
    return out[seq, pos]


def paged_prefill_attention_xla(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale=None,
    sliding_window=None, softcap=None, k_scale=None, v_scale=None,
):  # fmt: skip
    """q [total_q, H, D] (each sequence's last q_len tokens) over the paged cache -> [total_q, H, D]."""
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    return _paged_prefill_xla(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale,
        max_seqlen_q=int(max_seqlen_q), scale=scale, window=window, softcap=softcap,
    )  # fmt: skip


PAGED_PREFILL_ATTENTION.register_jax("xla", paged_prefill_attention_xla)
