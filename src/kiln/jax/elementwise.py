"""kiln.jax softmax, silu_and_mul, rope: validate like the torch API, then run the chosen implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.jax.checks import FLOAT_DTYPES, check_array, check_same_dtype
from kiln.ops.pallas_common import resolve

INDEX_DTYPES = (jnp.int32, jnp.int64)


def softmax(x: jax.Array, temperature: float = 1.0, implementation: str | None = None) -> jax.Array:
    """softmax(x / temperature) over the last dim of x `[..., n]` (f32/f16/bf16); float32 math, x's dtype."""
    check_array("softmax", "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    if x.shape[-1] == 0:
        raise ValueError(
            f"softmax: x has shape {tuple(x.shape)}; the last dim (softmax over it) must be non-empty"
        )
    if not temperature > 0:
        raise ValueError(f"softmax: temperature must be positive, got {temperature}")
    from kiln.ops.softmax import pallas

    impl = resolve("softmax", implementation)
    fn = {
        "pallas_tpu": pallas.softmax_pallas_tpu,
        "pallas_gpu": pallas.softmax_pallas_gpu,
        "xla": pallas.softmax_xla,
    }
    x2 = x.reshape(-1, x.shape[-1])
    if x2.size == 0:
        return x
    return fn[impl](x2, temperature).reshape(x.shape)


def silu_and_mul(x: jax.Array, implementation: str | None = None) -> jax.Array:
    """x `[..., 2*d]` (f32/f16/bf16) -> `silu(x[..., :d]) * x[..., d:]` `[..., d]`, float32 math."""
    return _gated("silu_and_mul", "silu", x, implementation)


def gelu_tanh_and_mul(x: jax.Array, implementation: str | None = None) -> jax.Array:
    """x `[..., 2*d]` -> `gelu_tanh(x[..., :d]) * x[..., d:]` `[..., d]` (Gemma's MLP), float32 math."""
    return _gated("gelu_tanh_and_mul", "gelu_tanh", x, implementation)


def _gated(op: str, activation: str, x, implementation):
    check_array(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise ValueError(
            f"{op}: x has last dim {x.shape[-1]}, expected an even size 2*d (gate and up halves concatenated)"
        )
    from kiln.ops.activation import pallas

    impl = resolve(op, implementation)
    fn = {
        "pallas_tpu": pallas.silu_and_mul_pallas_tpu,
        "pallas_gpu": pallas.silu_and_mul_pallas_gpu,
        "xla": pallas.silu_and_mul_xla,
    }
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.size == 0:
        return jnp.zeros((*x.shape[:-1], d), x.dtype)
    return fn[impl](x2, activation).reshape(*x.shape[:-1], d)


def rope(
    positions: jax.Array,
    q: jax.Array,
    k: jax.Array,
    cos_sin_cache: jax.Array,
    is_neox: bool = True,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Rotary embedding of q `[T, Hq, D]` and k `[T, Hk, D]` at `positions` int `[T]`, with
    `cos_sin_cache` `[max_position, rotary_dim]` (cos half then sin half). NeoX pairs (i, i + r/2)
    when `is_neox`, else GPT-J pairs (2i, 2i+1). Returns the rotated (q, k) (JAX arrays are
    immutable; the torch op rotates in place). Implementations: pallas_tpu, xla.
    """
    op = "rotary_embedding"
    check_array(op, "positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    check_array(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_array(op, "k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_array(op, "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    check_same_dtype(op, q=q, k=k)
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"{op}: k has shape {tuple(k.shape)}, expected [{tokens}, num_kv_heads, {head_dim}]")
    if positions.shape[0] != tokens:
        raise ValueError(
            f"{op}: q has {tokens} tokens (shape {tuple(q.shape)}), "
            f"expected {positions.shape[0]} as in positions"
        )
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"{op}: cos_sin_cache has rotary_dim {rotary_dim}, expected an even size <= head_dim {head_dim}"
        )
    from kiln.ops.rope import pallas

    impl = resolve(op, implementation, ("pallas_tpu", "xla"))
    if tokens == 0:
        return q, k
    if impl == "pallas_tpu":
        return pallas.rope_pallas_tpu(positions, q, k, cos_sin_cache, is_neox)
    return pallas.rope_xla(positions, q, k, cos_sin_cache, is_neox)
