"""paged_decode_attention in plain jax.numpy: gather every sequence's pages (padded to the block
table's width), then one masked attention over the padded batch (kiln.ops.attention.jax_common)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.attention.jax_common import attend_padded
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _paged_decode_xla(
    q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, scale, window, softcap
):
    batch, max_blocks = block_tables.shape
    block_size = key_cache.shape[1]
    tables = jnp.maximum(block_tables, 0)  # unused entries may be -1; what they gather is zeroed
    # Slots past a sequence's length are never read by contract and may hold anything (NaN too):
    # zero them, as the length mask alone leaves probability 0 times a NaN value in the sum.
    unread = jnp.arange(max_blocks * block_size)[None, :] >= seq_lens[:, None]

    def gather(cache, cache_scale):
        pages = cache[tables]  # [B, max_blocks, block_size, Hkv, D]
        pages = pages.reshape(batch, max_blocks * block_size, *cache.shape[2:])
        if cache_scale is not None:
            pages = (pages.astype(jnp.float32) * cache_scale[None, None, :, None]).astype(q.dtype)
        return jnp.where(unread[:, :, None, None], jnp.zeros((), q.dtype), pages.astype(q.dtype))

    k, v = gather(key_cache, k_scale), gather(value_cache, v_scale)
    ones = jnp.ones((batch,), jnp.int32)
    out, _ = attend_padded(q[:, None], k, v, ones, seq_lens, scale, True, window, softcap)
    return out[:, 0]


def paged_decode_attention_xla(
    q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
    k_scale=None, v_scale=None,
):  # fmt: skip
    """q [B, H, D] over the paged cache -> [B, H, D] (gathers each sequence's pages, then attends)."""
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    return _paged_decode_xla(
        q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale,
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap),
    )  # fmt: skip


PAGED_DECODE_ATTENTION.register_jax("xla", paged_decode_attention_xla)
