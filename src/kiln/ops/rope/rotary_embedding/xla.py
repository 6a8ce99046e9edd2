"""rotary_embedding in plain jax.numpy (XLA fuses it), on JAX arrays.

    positions int [T], q [T, Hq, D], k [T, Hk, D] (f32/f16/bf16),
    cos_sin_cache [max_position, rotary_dim] (first half cos, second half sin of the rotary_dim/2
    frequencies) -> (q', k') with the first rotary_dim dims of every head rotated:
      NeoX  (is_neox=True):  pairs (i, i + rotary_dim/2)
      GPT-J (is_neox=False): pairs (2i, 2i + 1)
JAX arrays are immutable: the rotated q and k come back as new arrays (the torch op's in-place
arguments). Math in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING


@functools.partial(jax.jit, static_argnames=("is_neox",))
def _rope_xla(positions, q, k, cos_sin_cache, is_neox):
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions].astype(jnp.float32)[:, None, :]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]

    def rotate(x):
        xf = x.astype(jnp.float32)
        rotary, rest = xf[..., : 2 * half], xf[..., 2 * half :]
        if is_neox:
            x1, x2 = rotary[..., :half], rotary[..., half:]
            rotary = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        else:
            x1, x2 = rotary[..., 0::2], rotary[..., 1::2]
            rotary = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rotary.shape)
        return jnp.concatenate([rotary, rest], axis=-1).astype(x.dtype)

    return rotate(q), rotate(k)


def rotary_embedding_xla(positions, q, k, cos_sin_cache, is_neox: bool = True):
    """Returns the rotated (q, k)."""
    if q.shape[0] == 0:
        return q, k
    return _rope_xla(positions, q, k, cos_sin_cache, is_neox=bool(is_neox))


ROTARY_EMBEDDING.register_jax("xla", rotary_embedding_xla)
