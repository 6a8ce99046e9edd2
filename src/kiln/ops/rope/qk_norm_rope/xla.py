"""qk_norm_rope in plain jax.numpy (XLA fuses it), on JAX arrays.

    positions int [T], q [T, Hq, D], k [T, Hk, D] (f32/f16/bf16), q_weight/k_weight [D],
    cos_sin_cache [max_position, rotary_dim] -> (q', k'): every head row normalized over D
    (x * rsqrt(mean(x^2) + eps) * weight), then its first rotary_dim dims rotated as
    rotary_embedding does (NeoX pairs (i, i + r/2), GPT-J pairs (2i, 2i + 1)).
Math in float32, one rounding at the end. JAX arrays are immutable: the new q and k come back as new
arrays (the torch op's in-place arguments).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.rope.qk_norm_rope.spec import QK_NORM_ROPE


def _rotate(y, cos, sin, is_neox):
    """y float32 [T, H, D], cos/sin [T, 1, r/2]: the first r dims rotated."""
    half = cos.shape[-1]
    rotary, rest = y[..., : 2 * half], y[..., 2 * half :]
    if is_neox:
        y1, y2 = rotary[..., :half], rotary[..., half:]
        rotary = jnp.concatenate([y1 * cos - y2 * sin, y2 * cos + y1 * sin], axis=-1)
    else:
        y1, y2 = rotary[..., 0::2], rotary[..., 1::2]
        rotary = jnp.stack([y1 * cos - y2 * sin, y2 * cos + y1 * sin], axis=-1).reshape(rotary.shape)
    return jnp.concatenate([rotary, rest], axis=-1)


@functools.partial(jax.jit, static_argnames=("eps", "is_neox"))
def _qk_norm_rope_xla(positions, q, k, q_weight, k_weight, cos_sin_cache, eps, is_neox):
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions].astype(jnp.float32)[:, None, :]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]

    def norm_rotate(x, weight):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * weight.astype(jnp.float32)
        return _rotate(y, cos, sin, is_neox).astype(x.dtype)

    return norm_rotate(q, q_weight), norm_rotate(k, k_weight)


def qk_norm_rope_xla(
    positions, q, k, q_weight, k_weight, cos_sin_cache, eps: float = 1e-6, is_neox: bool = True
):
    """Returns the normalized and rotated (q, k)."""
    if q.shape[0] == 0:
        return q, k
    return _qk_norm_rope_xla(
        positions, q, k, q_weight, k_weight, cos_sin_cache, eps=float(eps), is_neox=bool(is_neox)
    )


QK_NORM_ROPE.register_jax("xla", qk_norm_rope_xla)
