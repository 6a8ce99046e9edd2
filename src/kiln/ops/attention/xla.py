"""Attention in plain jax.numpy (the "xla" implementations): scores materialized, masked, softmaxed.
Same arguments and results as the Pallas kernels in pallas.py / pallas_paged.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.attention.pallas import NEG_INF, visible_mask


def _attend(q, k, v, q_lens, kv_lens, scale, causal, window, softcap):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D], lse float32 [B, H, Sq])."""
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    qg = q.reshape(q.shape[0], q.shape[1], kv_heads, group, q.shape[3])
    s = (
        jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32, precision=precision)
        * scale
    )
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    rows = jnp.arange(q.shape[1])[:, None]
    cols = jnp.arange(k.shape[1])[None, :]
    offset = (kv_lens - q_lens)[:, None, None, None, None]
    mask = visible_mask(rows, cols, offset, kv_lens[:, None, None, None, None], causal, window)
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    p = jnp.exp(s - m_safe)
    l_ = jnp.sum(p, axis=-1, keepdims=True)
    seen = l_ > 0
    out = jnp.einsum(
        "bkgqs,bskd->bqkgd", p / jnp.where(seen, l_, 1.0), v.astype(jnp.float32), precision=precision
    )
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, l_, 1.0)), NEG_INF)[..., 0]
    return out.reshape(q.shape).astype(q.dtype), lse.reshape(q.shape[0], heads, q.shape[1])


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "softcap"))
def _flash_xla(q, k, v, q_lens, kv_lens, scale, causal, window, softcap):
    return _attend(q, k, v, q_lens, kv_lens, scale, causal, window, softcap)


def flash_attention_xla(q, k, v, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None):
    """Returns (out [B, Sq, H, D], lse [B, H, Sq])."""
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    window = None if sliding_window is None else int(sliding_window)
    return _flash_xla(
        q, k, v, q_lens, kv_lens, scale=scale, causal=bool(causal), window=window,
        softcap=None if softcap is None else float(softcap),
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap"))
def _paged_decode_xla(
    q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, scale, window, softcap
):
    batch, max_blocks = block_tables.shape
    block_size = key_cache.shape[1]
    tables = jnp.maximum(block_tables, 0)  # unused entries may be -1; the length mask hides them

    def gather(cache, cache_scale):
        pages = cache[tables]  # [B, max_blocks, block_size, Hkv, D]
        pages = pages.reshape(batch, max_blocks * block_size, *cache.shape[2:])
        if cache_scale is not None:
            return (pages.astype(jnp.float32) * cache_scale[None, None, :, None]).astype(q.dtype)
        return pages.astype(q.dtype)

    k, v = gather(key_cache, k_scale), gather(value_cache, v_scale)
    ones = jnp.ones((batch,), jnp.int32)
    out, _ = _attend(q[:, None], k, v, ones, seq_lens, scale, True, window, softcap)
    return out[:, 0]


def paged_decode_attention_xla(
    q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
    k_scale=None, v_scale=None,
):  # fmt: skip
    """q [B, H, D] over the paged cache -> [B, H, D] (gathers each sequence's pages, then attends)."""
    return _paged_decode_xla(
        q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale,
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap),
    )  # fmt: skip
