"""write_kv_cache in plain jax.numpy: one scatter per cache into its flat [slots, Hkv, D] view, and
the conversion to the cache's dtype that the Pallas kernel shares.

JAX arrays are immutable: the backends return the new (key_cache, value_cache) (the torch op's
in-place arguments); under jit with the caches donated, XLA updates them in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.ops.attention.write_kv_cache.spec import WRITE_KV_CACHE
from kiln.ops.jax_div_rn import div_rn

FP8_MAX = 448.0  # largest finite float8_e4m3fn; casting beyond it gives NaN, so saturate first


def to_cache_dtype(rows, cache_dtype, scale, *, compiled: str | None = None):
    """rows [..., Hkv, D] as stored in a cache of `cache_dtype`: divided by scale [Hkv, 1] (float32,
    rounded once: div_rn, `compiled` as its), saturated to +-448 and rounded to nearest for fp8 caches;
    a plain cast otherwise."""
    if scale is None:
        return rows.astype(cache_dtype)
    scaled = div_rn(rows, scale, compiled=compiled)
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(cache_dtype)


@jax.jit
def _write_xla(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    # Negative slots (padding) are skipped: send them past the end, where mode="drop" ignores them
    # (a negative index would wrap around to the last slots).
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping).astype(jnp.int32)

    def scatter(cache, rows, scale):
        scale = None if scale is None else scale.reshape(-1, 1)
        flat = cache.reshape(num_slots, *cache.shape[2:])
        flat = flat.at[slots].set(to_cache_dtype(rows, cache.dtype, scale), mode="drop")
        return flat.reshape(cache.shape)

    return scatter(key_cache, key, k_scale), scatter(value_cache, value, v_scale)


def write_kv_cache_xla(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    """key/value [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (negative = skip) -> the new (key_cache, value_cache)."""
    if key.shape[0] == 0:
        return key_cache, value_cache
    return _write_xla(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


WRITE_KV_CACHE.register_jax("xla", write_kv_cache_xla)
