"""paged_decode_attention in plain jax.numpy: gather every sequence's pages (padded to the block
table's width; an fp8 cache's exact positions taken from the exact caches before the scale), then one
masked attention over the padded batch (kiln.ops.attention.jax_common)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.attention.jax_common import attend_padded, gather_kv_pages, static_options
from kiln.ops.attention.jax_exact import static_exact_window
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "exact_window"))
def _paged_decode_xla(
    q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, exact_key_cache,
    exact_value_cache, exact_block_tables, scale, window, softcap, exact_window,
):  # fmt: skip
    k, v = gather_kv_pages(
        key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, exact_key_cache, exact_value_cache,
        exact_block_tables, exact_window, q.dtype,
    )  # fmt: skip
    ones = jnp.ones((q.shape[0],), jnp.int32)
    out, _ = attend_padded(q[:, None], k, v, ones, seq_lens, scale, True, window, softcap)
    return out[:, 0]


def paged_decode_attention_xla(
    q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
    k_scale=None, v_scale=None, exact_key_cache=None, exact_value_cache=None, exact_block_tables=None,
    exact_window=0,
):  # fmt: skip
    """q [B, H, D] over the paged cache -> [B, H, D] (gathers each sequence's pages, then attends)."""
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    return _paged_decode_xla(
        q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, exact_key_cache,
        exact_value_cache, exact_block_tables, scale=scale, window=window, softcap=softcap,
        exact_window=static_exact_window(exact_block_tables, exact_window),
    )  # fmt: skip


PAGED_DECODE_ATTENTION.register_jax("xla", paged_decode_attention_xla)
