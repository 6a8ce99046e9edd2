"""One Llama decoder layer written with kiln.jax ops: the proof that the Pallas kernels compose
under jax.jit. Prefill (flash attention over the prompt) and decode (paged attention over a KV
cache in the engine's layout, docs/contracts.md) share the weights and the math:

    a = rms_norm(x, attn_norm);  q, k, v = a Wq^T, a Wk^T, a Wv^T;  q, k = rope(q, k)
    h = x + attention(q, k, v) Wo^T
    m = rms_norm(h, ffn_norm);   out = h + (silu(m Wg^T) * (m Wu^T)) Wd^T

Weights use the checkpoint's [out, in] layout; `gate_up` is [2 * intermediate, hidden] (gate rows
first). `is_neox=False` (GPT-J pairs) matches llama.cpp's GGUF, whose Q/K rows are permuted for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

import kiln.jax as kjax


@dataclass(frozen=True)
class LlamaLayerConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    is_neox: bool = True


LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "gate_up", "down")


def _attention_inputs(x, positions, weights, config, cos_sin_cache, implementation):
    tokens, gemm = x.shape[0], implementation
    a = kjax.rms_norm(x, weights["attn_norm"], config.rms_norm_eps, implementation=implementation)
    q = kjax.linear(a, weights["wq"], implementation=gemm).reshape(tokens, config.num_heads, -1)
    k = kjax.linear(a, weights["wk"], implementation=gemm).reshape(tokens, config.num_kv_heads, -1)
    v = kjax.linear(a, weights["wv"], implementation=gemm).reshape(tokens, config.num_kv_heads, -1)
    q, k = kjax.rotary_embedding(
        positions, q, k, cos_sin_cache, config.is_neox, implementation=_tpu_or_xla(implementation)
    )
    return q, k, v


def _tpu_or_xla(implementation):
    """RoPE and paged decode have no Triton kernels: pallas_gpu falls back to the default."""
    return None if implementation == "pallas_gpu" else implementation


def _finish(x, attn, weights, config, implementation):
    gemm = implementation
    o = kjax.linear(attn.reshape(x.shape[0], -1), weights["wo"], implementation=gemm)
    m, h = kjax.rms_norm(
        o, weights["ffn_norm"], config.rms_norm_eps, residual=x, implementation=implementation
    )
    gate_up = kjax.linear(m, weights["gate_up"], implementation=gemm)
    act = kjax.silu_and_mul(gate_up, implementation=implementation)
    return h + kjax.linear(act, weights["down"], implementation=gemm)


@functools.partial(jax.jit, static_argnames=("config", "implementation"))
def prefill(x, positions, weights, cos_sin_cache, config: LlamaLayerConfig, implementation=None):
    """x [T, hidden] of one sequence at `positions` int32 [T] -> (out [T, hidden], k, v [T, Hkv, D]),
    causal attention among the T tokens."""
    q, k, v = _attention_inputs(x, positions, weights, config, cos_sin_cache, implementation)
    attn = kjax.flash_attention(q[None], k[None], v[None], causal=True, implementation=implementation)[0]
    return _finish(x, attn, weights, config, implementation), k, v


@functools.partial(jax.jit, static_argnames=("config", "implementation"))
def decode(
    x, positions, weights, cos_sin_cache, key_cache, value_cache, block_tables, seq_lens,
    config: LlamaLayerConfig, implementation=None,
):  # fmt: skip
    """One new token per sequence: x [B, hidden] at `positions` [B] (= seq_lens - 1). Its k/v are
    written into the paged cache at its slot (block_tables[b, pos // block_size], pos % block_size),
    then it attends over the whole context. Returns (out [B, hidden], key_cache, value_cache)."""
    q, k, v = _attention_inputs(x, positions, weights, config, cos_sin_cache, implementation)
    block_size = key_cache.shape[1]
    rows = jnp.arange(x.shape[0])
    blocks = block_tables[rows, positions // block_size]
    key_cache = key_cache.at[blocks, positions % block_size].set(k.astype(key_cache.dtype))
    value_cache = value_cache.at[blocks, positions % block_size].set(v.astype(value_cache.dtype))
    attn = kjax.paged_decode_attention(
        q, key_cache, value_cache, block_tables, seq_lens, implementation=_tpu_or_xla(implementation)
    )
    return _finish(x, attn, weights, config, implementation), key_cache, value_cache
