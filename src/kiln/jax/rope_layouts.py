"""The rotary-embedding names kiln.jax had before its entries were generated from the op specs.

    rope(positions, q, k, cos_sin_cache, is_neox=True, implementation=None) -> (q', k')
        the old name of `kiln.jax.rotary_embedding` (same arguments, validation and results; here
        `implementation` may also be passed positionally).
    rope_cos_sin_cache(rotary_dim, max_position, base=10000.0, dtype=jnp.float32, scaling=None)
        `kiln.ops.rope_cos_sin_cache` as a jax array [max_position, rotary_dim] (cos half, then sin).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

from kiln.ops import get_op
from kiln.ops.jax_bridge import jax_function
from kiln.ops.rope.cache import rope_cos_sin_cache as _torch_cos_sin_cache


@functools.cache
def _rotary_embedding() -> Callable[..., tuple[jax.Array, jax.Array]]:
    """`kiln.jax.rotary_embedding`, the entry generated from the op's spec."""
    return jax_function(get_op("rotary_embedding"))


def rope(
    positions: jax.Array,
    q: jax.Array,
    k: jax.Array,
    cos_sin_cache: jax.Array,
    is_neox: bool = True,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Rotary embedding of q `[T, Hq, D]` and k `[T, Hk, D]` at `positions` int `[T]` with
    `cos_sin_cache` `[max_position, rotary_dim]`; returns the rotated (q, k). See
    `kiln.jax.rotary_embedding` (implementations: pallas_tpu, xla)."""
    return _rotary_embedding()(positions, q, k, cos_sin_cache, is_neox, implementation=implementation)


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float = 10000.0,
    dtype=jnp.float32,
    scaling: dict | None = None,
) -> jax.Array:
    """[max_position, rotary_dim]: cos then sin of position * f_i for the rotary_dim / 2 frequencies
    f_i = base^(-2i / rotary_dim) (adjusted by `scaling`, as in `kiln.ops.rope_cos_sin_cache`).
    Angles in float64, rounded once to `dtype`."""
    table = _torch_cos_sin_cache(rotary_dim, max_position, base, scaling, torch.float64)
    return jnp.asarray(table.numpy(), dtype=dtype)
