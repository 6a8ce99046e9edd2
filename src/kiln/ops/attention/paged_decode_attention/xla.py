"""paged_decode_attention in plain jax.numpy: gather every sequence's pages (padded to the block
table's width), then one masked attention over the padded batch (kiln.ops.attention.jax_common)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.attention.jax_common import attend_padded, gather_pages, static_options
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _paged_decode_xla(
    q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, scale, window, softcap
):
    k = gather_pages(key_cache, block_tables, seq_lens, k_scale, q.dtype)
    v = gather_pages(value_cache, block_tables, seq_lens, v_scale, q.dtype)
    ones = jnp.ones((q.shape[0],), jnp.int32)
    out, _ = attend_padded(q[:, None], k, v, ones, seq_lens, scale, True, window, softcap)
    return out[:, 0]


def paged_decode_attention_xla(
    q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
    k_scale=None, v_scale=None,
):  # fmt: skip
    """q [B, H, D] over the paged cache -> [B, H, D] (gathers each sequence's pages, then attends)."""
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    return _paged_decode_xla(
        q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, scale=scale, window=window,
        softcap=softcap,
    )  # fmt: skip


PAGED_DECODE_ATTENTION.register_jax("xla", paged_decode_attention_xla)
