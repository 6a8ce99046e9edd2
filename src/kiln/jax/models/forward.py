"""The JAX Llama's forward pass: one prefill step and one decode step, each embedding -> decoder
layers -> final norm -> LM head -> the next token, written with kiln.jax ops:

    delta, h = embed, 0;  per layer:  a, h = rms_norm(delta, attn_norm, residual=h)
        q, k, v = split(linear(a, qkv));  q, k = rotary_embedding(positions, q, k)
        write k, v into the paged cache;  attn = attention(q, cache)
        m, h = rms_norm(psum(linear(attn, o)), ffn_norm, residual=h)
        delta = psum(linear(silu_and_mul(linear(m, gate_up)), down))
    out = rms_norm(delta, norm, residual=h);  logits = linear(out, lm_head)

(rms_norm with a residual adds it first and returns the sum as the new residual, as the PyTorch
model does.) The functions are written for one tensor-parallel shard: with config.tp > 1 they run
under shard_map (kiln.jax.models.sharding), see 1/tp of the heads and MLP columns, and add the
row-parallel o / down partial sums with a psum over the mesh axis "tp".

Ops: rms_norm, linear, silu_and_mul, rotary_embedding, write_kv_cache, flash_attention (prefill,
the padded-batch entry kiln.jax.flash_attention with per-row lengths: a prompt attends to itself,
there is no cached prefix, so paged_prefill_attention is not needed) and paged_decode_attention
(decode) from kiln.jax, in config.implementation. An op without that backend runs the device
default (xla on the CPU), e.g. write_kv_cache under pallas_gpu. Where write_kv_cache has no JAX
implementation registered at all, the write is a JAX scatter (`.at[].set`) with the same meaning.

Layers are a Python loop, unrolled under jit. A `lax.scan` over layer-stacked weights compiles
faster but ran 3.5x slower on the CPU (4.8 vs 16.5 tok/s single-stream on SmolLM2-135M; XLA
appears to copy each layer's slice of the stacked weights every step).

Cache: one (key_cache, value_cache) per layer, each [num_blocks, block_size, Hkv / tp, D]. Block 0
is a scratch page, never given to a sequence: padding rows of a decode batch write to and read
from it; padding tokens of a prefill are not written (slot -1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kiln.jax.attention_layouts import flash_attention
from kiln.jax.autodiff import rms_norm, silu_and_mul
from kiln.jax.models.config import JaxLlamaConfig
from kiln.ops import get_op
from kiln.ops.jax_bridge import jax_function

# kiln.jax's entries, taken from where kiln.jax takes them (this package is imported by kiln.jax).
linear = jax_function(get_op("linear"))
rotary_embedding = jax_function(get_op("rotary_embedding"))
paged_decode_attention = jax_function(get_op("paged_decode_attention"))
TP_AXIS = "tp"


def _impl(op: str, implementation: str | None) -> str | None:
    """`implementation` when op has it in kiln.jax, else None (the device default)."""
    return implementation if implementation in get_op(op).jax_implementations else None


def _psum(x: jax.Array, c: JaxLlamaConfig) -> jax.Array:
    return jax.lax.psum(x, TP_AXIS) if c.tp > 1 else x


# attend(q [T, Hq, D], k, v [T, Hkv, D], key_cache_l, value_cache_l) -> (attn [T, Hq, D], caches)
Attend = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def _decoder(params, delta, positions, rope, caches, attend: Attend, c: JaxLlamaConfig):
    """All layers over tokens delta [T, hidden] at positions [T] -> (out [T, hidden], caches)."""
    impl, eps, d = c.implementation, c.rms_norm_eps, c.head_dim
    heads, kv_heads = c.num_heads // c.tp, c.num_kv_heads // c.tp
    tokens = delta.shape[0]
    h = jnp.zeros_like(delta)
    new_caches = []
    for w, (key_cache, value_cache) in zip(params["layers"], caches, strict=True):
        a, h = rms_norm(delta, w["attn_norm"], eps, residual=h, implementation=impl)
        qkv = linear(a, w["qkv"], w.get("qkv_bias"), implementation=_impl("linear", impl))
        q, k, v = jnp.split(qkv, [heads * d, (heads + kv_heads) * d], axis=-1)
        q, k = rotary_embedding(
            positions,
            q.reshape(tokens, heads, d),
            k.reshape(tokens, kv_heads, d),
            rope,
            True,
            implementation=_impl("rotary_embedding", impl),
        )
        attn, key_cache, value_cache = attend(q, k, v.reshape(tokens, kv_heads, d), key_cache, value_cache)
        new_caches.append((key_cache, value_cache))
        o = _psum(linear(attn.reshape(tokens, heads * d), w["o"], implementation=impl), c)
        m, h = rms_norm(o, w["ffn_norm"], eps, residual=h, implementation=impl)
        act = silu_and_mul(linear(m, w["gate_up"], implementation=impl), implementation=impl)
        delta = _psum(linear(act, w["down"], implementation=impl), c)
    out, _ = rms_norm(delta, params["norm"], eps, residual=h, implementation=impl)
    return out, new_caches


@functools.cache
def _write_kv_cache_entry():
    """kiln.jax.write_kv_cache when the op has JAX implementations registered, else None."""
    spec = get_op("write_kv_cache")
    return jax_function(spec) if spec.jax_implementations else None


def _write(k, v, key_cache, value_cache, slots, implementation):
    """k, v [T, Hkv, D] into the layer's caches [num_blocks, block_size, Hkv, D] at slots int32 [T]
    (block * block_size + offset; negative: padding, not written) -> the new caches."""
    entry = _write_kv_cache_entry()
    if entry is not None:
        impl = _impl("write_kv_cache", implementation)
        return entry(k, v, key_cache, value_cache, slots, implementation=impl)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = jnp.where(slots < 0, num_slots, slots)  # past the end: dropped

    def scatter(cache, rows):
        flat = cache.reshape(num_slots, *cache.shape[2:])
        return flat.at[slots].set(rows.astype(cache.dtype), mode="drop").reshape(cache.shape)

    return scatter(key_cache, k), scatter(value_cache, v)


def sample(logits, key, temperature):
    """logits float32 [B, V] -> int32 [B]: argmax where temperature <= 0, else a draw from
    softmax(logits / temperature) with `key`."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def _embed(params, tokens, c: JaxLlamaConfig) -> jax.Array:
    """tokens int32 [...] -> [..., hidden]. Under tp each device holds rows [i * V/tp, (i+1) * V/tp) of
    the embedding: it looks up the tokens in its range, zeros for the rest, and a psum adds them."""
    table = params["embed"]
    if c.tp == 1:
        return table[tokens]
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(TP_AXIS) * rows
    mine = (local >= 0) & (local < rows)
    found = table[jnp.clip(local, 0, rows - 1)]
    return _psum(jnp.where(mine[..., None], found, jnp.zeros((), table.dtype)), c)


def _next_tokens(params, out, key, temperature, c):
    logits = linear(out, params["lm_head"], implementation=_impl("linear", c.implementation))
    logits = logits.astype(jnp.float32)
    if c.tp > 1:  # this device's vocabulary slice -> the whole (padded) row, the same on every device
        logits = jax.lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)
    if c.padded_vocab_size != c.vocab_size:
        logits = logits[:, : c.vocab_size]
    return sample(logits, key, temperature)


def prefill_step(params, rope, caches, tokens, lens, block_tables, key, temperature, *, config):
    """Prompts tokens int32 [B, S] (row b valid up to lens[b] >= 1, right-padded) -> (next token
    int32 [B] after each prompt, caches with every prompt token's K/V written at its page
    block_tables[b, pos // block_size]). Attention is causal within each prompt (no cached prefix)."""
    c = config
    batch, seq = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    blocks = jnp.take_along_axis(block_tables, positions // c.block_size, axis=1)
    slots = jnp.where(positions < lens[:, None], blocks * c.block_size + positions % c.block_size, -1)
    slots = slots.reshape(-1)
    impl = _impl("flash_attention", c.implementation)

    def attend(q, k, v, key_cache_l, value_cache_l):
        key_cache_l, value_cache_l = _write(k, v, key_cache_l, value_cache_l, slots, c.implementation)

        def padded(x):
            return x.reshape(batch, seq, *x.shape[1:])

        attn = flash_attention(
            padded(q), padded(k), padded(v), causal=True, implementation=impl,
            sliding_window=c.sliding_window, q_lens=lens, kv_lens=lens,
        )  # fmt: skip
        return attn.reshape(q.shape), key_cache_l, value_cache_l

    delta = _embed(params, tokens.reshape(-1), c)
    out, caches = _decoder(params, delta, positions.reshape(-1), rope, caches, attend, c)
    last = out.reshape(batch, seq, -1)[jnp.arange(batch), lens - 1]
    return _next_tokens(params, last, key, temperature, c), caches


def decode_step(params, rope, caches, tokens, positions, block_tables, key, temperature, *, config):
    """One token per sequence: tokens int32 [B] at positions int32 [B] (the context before it) ->
    (next token int32 [B], caches with its K/V written). Attends over positions + 1 cached tokens."""
    c = config
    batch = tokens.shape[0]
    blocks = block_tables[jnp.arange(batch), positions // c.block_size]
    slots = blocks * c.block_size + positions % c.block_size
    seq_lens = positions + 1
    impl = _impl("paged_decode_attention", c.implementation)

    def attend(q, k, v, key_cache_l, value_cache_l):
        key_cache_l, value_cache_l = _write(k, v, key_cache_l, value_cache_l, slots, c.implementation)
        attn = paged_decode_attention(
            q, key_cache_l, value_cache_l, block_tables, seq_lens,
            sliding_window=c.sliding_window, implementation=impl,
        )  # fmt: skip
        return attn, key_cache_l, value_cache_l

    delta = _embed(params, tokens, c)
    out, caches = _decoder(params, delta, positions, rope, caches, attend, c)
    return _next_tokens(params, out, key, temperature, c), caches
