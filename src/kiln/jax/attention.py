"""kiln.jax flash_attention and paged_decode_attention: validate like the torch API, then run the
chosen implementation. flash_attention: pallas_tpu, pallas_gpu, xla; paged_decode_attention:
pallas_tpu, xla (None on a GPU picks xla)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.jax.checks import FLOAT_DTYPES, check_array, check_same_dtype
from kiln.ops.pallas_common import resolve

FP8_DTYPES = (jnp.float8_e4m3fn,)


def _check_options(op, scale, sliding_window, softcap):
    for name, value in (("scale", scale), ("sliding_window", sliding_window), ("softcap", softcap)):
        if value is not None and not value > 0:
            raise ValueError(f"{op}: {name} must be positive or None, got {value!r}")
    if sliding_window is not None and int(sliding_window) != sliding_window:
        raise ValueError(f"{op}: sliding_window must be an int, got {sliding_window!r}")


def _check_heads(op, num_heads, num_kv_heads):
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"{op}: num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA groups)"
        )


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool = True,
    scale: float | None = None,
    implementation: str | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    q_lens: jax.Array | None = None,
    kv_lens: jax.Array | None = None,
    return_lse: bool = False,
):
    """Attention in jax.nn.dot_product_attention's layout: q `[B, Sq, H, D]`, k/v `[B, Sk, Hkv, D]`
    (f32/f16/bf16, H % Hkv == 0) -> out `[B, Sq, H, D]` in q's dtype (and lse float32 `[B, H, Sq]`).

    Causal masks are bottom-right aligned (query i sees keys j <= i + Sk - Sq); `sliding_window` W
    additionally keeps i + Sk - Sq - j < W; `softcap` c maps scores s to c * tanh(s / c). Optional
    `q_lens`/`kv_lens` int32 `[B]` give per-row valid lengths (padded varlen batches); outputs past
    a row's q_len are unspecified. scale defaults to D ** -0.5.
    """
    op = "flash_attention"
    check_array(op, "q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_array(op, "k", k, ndim=4)
    check_array(op, "v", v, ndim=4)
    check_same_dtype(op, q=q, k=k, v=v)
    if v.shape != k.shape:
        raise ValueError(f"{op}: v has shape {tuple(v.shape)}, expected k's {tuple(k.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"{op}: k has shape {tuple(k.shape)}, expected [{q.shape[0]}, seq_k, num_kv_heads, {q.shape[3]}]"
        )
    _check_heads(op, q.shape[2], k.shape[2])
    _check_options(op, scale, sliding_window, softcap)
    batch = q.shape[0]
    for name, lens in (("q_lens", q_lens), ("kv_lens", kv_lens)):
        if lens is not None:
            check_array(op, name, lens, ndim=1, dtypes=(jnp.int32,))
            if lens.shape[0] != batch:
                raise ValueError(f"{op}: {name} has {lens.shape[0]} entries, expected batch {batch}")
    q_lens = jnp.full((batch,), q.shape[1], jnp.int32) if q_lens is None else q_lens
    kv_lens = jnp.full((batch,), k.shape[1], jnp.int32) if kv_lens is None else kv_lens
    from kiln.ops.attention import pallas, xla

    impl = resolve(op, implementation)
    if q.size == 0 or k.shape[1] == 0:
        out = jnp.zeros(q.shape, q.dtype)
        lse = jnp.full((batch, q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
    else:
        fn = {
            "pallas_tpu": pallas.flash_attention_pallas_tpu,
            "pallas_gpu": pallas.flash_attention_pallas_gpu,
            "xla": xla.flash_attention_xla,
        }[impl]
        out, lse = fn(q, k, v, q_lens, kv_lens, causal, scale, sliding_window, softcap)
    return (out, lse) if return_lse else out


def paged_decode_attention(
    q: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """One query token per sequence, q `[B, H, D]`, over the paged cache `[num_blocks, block_size,
    Hkv, D]` (q's dtype, or float8_e4m3fn with k_scale/v_scale float32 `[Hkv]`), block_tables int32
    `[B, max_blocks_per_seq]`, seq_lens int32 `[B]` (including the new token) -> `[B, H, D]`."""
    op = "paged_decode_attention"
    check_array(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_array(op, "key_cache", key_cache, ndim=4, dtypes=(q.dtype, *FP8_DTYPES))
    check_array(op, "value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,))
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"{op}: value_cache has shape {tuple(value_cache.shape)}, expected key_cache's")
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    if head_dim != q.shape[2]:
        raise ValueError(f"{op}: key_cache has head_dim {head_dim}, expected q's head_dim {q.shape[2]}")
    if block_size & (block_size - 1):
        raise ValueError(f"{op}: key_cache block_size {block_size} must be a power of two")
    _check_heads(op, q.shape[1], kv_heads)
    quantized = jnp.dtype(key_cache.dtype) in [jnp.dtype(d) for d in FP8_DTYPES]
    if quantized and (k_scale is None or v_scale is None):
        raise ValueError(f"{op}: an fp8 cache needs k_scale and v_scale (float32 [{kv_heads}])")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None:
            check_array(op, name, s, ndim=1, dtypes=(jnp.float32,))
            if s.shape[0] != kv_heads:
                raise ValueError(f"{op}: {name} has {s.shape[0]} entries, expected num_kv_heads {kv_heads}")
    check_array(op, "block_tables", block_tables, ndim=2, dtypes=(jnp.int32,))
    check_array(op, "seq_lens", seq_lens, ndim=1, dtypes=(jnp.int32,))
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(
            f"{op}: block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
            f"need one row per sequence ({q.shape[0]})"
        )
    _check_options(op, scale, sliding_window, softcap)
    from kiln.ops.attention import pallas_paged, xla

    impl = resolve(op, implementation, ("pallas_tpu", "xla"))
    if q.size == 0:
        return jnp.zeros(q.shape, q.dtype)
    fn = (
        pallas_paged.paged_decode_attention_pallas_tpu
        if impl == "pallas_tpu"
        else xla.paged_decode_attention_xla
    )
    return fn(
        q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale, v_scale
    )
