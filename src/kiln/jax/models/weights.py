"""A Kiln checkpoint's Llama weights as a NumPy pytree in the JAX model's layout.

Weights are read through Kiln's loaders (the checkpoint's WeightStore, HF tensor names; GGUF files'
Q/K rows are already un-permuted by kiln.loaders.gguf), quantized ones dequantized to float32 by
their own `.dequantize` (GGUFWeight, the quantized checkpoint weights), dense ones taken as they
are; there is no second parser.

Layout for a tensor-parallel degree tp (tp = 1 is the plain fused layout):
  qkv      [q + 2 kv, hidden] (q = num_heads * D, kv = num_kv_heads * D): rows in tp chunks, chunk
           i = [q_i; k_i; v_i], the
           q / k / v rows of shard i's heads, so that a contiguous 1/tp slice of the rows is one
           shard's fused projection (column parallel);
  gate_up  [2 * intermediate, hidden]: chunk i = [gate_i; up_i];
  o        [hidden, num_heads * D] and down [hidden, intermediate]: split by columns (row
           parallel: each shard's partial sums are added with a psum).
Heads are zero-padded up to a multiple of tp (KV heads, and the query heads of each padded KV
group): a zero query row and zero value rows give an exactly-zero head output, and its o columns
are zero too, so padding changes no result (it only lets e.g. 3 KV heads run on 2 devices).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import kiln.ops
from kiln.jax.models.config import JaxLlamaConfig

LAYER_KEYS = ("attn_norm", "qkv", "o", "ffn_norm", "gate_up", "down")


def dense_float32(weight: Any) -> np.ndarray:
    """One checkpoint weight as a float32 NumPy array: quantized weights (GGUF blocks, W8A8, int4,
    FP8 blocks) through their `.dequantize(torch.float32)`, torch tensors converted."""
    if hasattr(weight, "dequantize") and not isinstance(weight, torch.Tensor):
        weight = weight.dequantize(torch.float32)
    return weight.detach().to("cpu", torch.float32).contiguous().numpy()


def _pad_rows(rows: np.ndarray, heads: int, padded_heads: int, head_dim: int) -> np.ndarray:
    """[heads * D, ...] -> [padded_heads * D, ...], the new heads' rows zero."""
    extra = (padded_heads - heads) * head_dim
    return np.concatenate([rows, np.zeros((extra, *rows.shape[1:]), rows.dtype)]) if extra else rows


def _pad_q(q: np.ndarray, c: JaxLlamaConfig) -> np.ndarray:
    """q rows [Hq * D, ...]: the padded KV heads' query groups appended as zero heads."""
    return _pad_rows(q, c.real_num_heads, c.num_heads, c.head_dim)


def _interleave(parts: list[np.ndarray], tp: int) -> np.ndarray:
    """Concatenate `parts` (each [rows_p, ...], rows_p % tp == 0) shard by shard: [p0_0; p1_0; ...;
    p0_1; p1_1; ...], where p_i is the i-th of tp equal row chunks of p."""
    chunks = [np.split(p, tp) for p in parts]
    return np.concatenate([chunk[i] for i in range(tp) for chunk in chunks])


def load_layer(weights: Any, c: JaxLlamaConfig, index: int) -> dict[str, np.ndarray]:
    """Layer `index`'s arrays in the layout above (qkv_bias too when the model has q/k/v biases)."""
    p, hidden, inter, d = f"model.layers.{index}.", c.hidden_size, c.intermediate_size, c.head_dim
    q_real, kv_real = c.real_num_heads * d, c.real_num_kv_heads * d

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return dense_float32(weights.get(p + name, shape))

    q = _pad_q(get("self_attn.q_proj.weight", (q_real, hidden)), c)
    k = _pad_rows(get("self_attn.k_proj.weight", (kv_real, hidden)), c.real_num_kv_heads, c.num_kv_heads, d)
    v = _pad_rows(get("self_attn.v_proj.weight", (kv_real, hidden)), c.real_num_kv_heads, c.num_kv_heads, d)
    o = get("self_attn.o_proj.weight", (hidden, q_real))
    o = _pad_rows(o.T, c.real_num_heads, c.num_heads, d).T
    layer = {
        "attn_norm": get("input_layernorm.weight", (hidden,)),
        "qkv": _interleave([q, k, v], c.tp),
        "o": np.ascontiguousarray(o),
        "ffn_norm": get("post_attention_layernorm.weight", (hidden,)),
        "gate_up": _interleave(
            [get("mlp.gate_proj.weight", (inter, hidden)), get("mlp.up_proj.weight", (inter, hidden))], c.tp
        ),
        "down": get("mlp.down_proj.weight", (hidden, inter)),
    }
    if c.attention_bias:
        bq = _pad_q(get("self_attn.q_proj.bias", (q_real,)), c)
        bk, bv = (
            _pad_rows(get(f"self_attn.{n}_proj.bias", (kv_real,)), c.real_num_kv_heads, c.num_kv_heads, d)
            for n in "kv"
        )
        layer["qkv_bias"] = _interleave([bq, bk, bv], c.tp)
    return layer


def load_params(checkpoint: Any, c: JaxLlamaConfig, dtype: np.dtype) -> dict[str, Any]:
    """{"embed" [V', hidden], "lm_head" [V', hidden] (the embedding when tied; V' = V rounded up to a
    multiple of tp, zero rows appended), "norm" [hidden],
    "layers": one {name: array} per layer} in `dtype`, from an opened checkpoint
    (kiln.loaders.open_checkpoint)."""
    weights, mc = checkpoint.weights, checkpoint.config
    embed = dense_float32(weights.get("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)))
    head = embed
    if not mc.tie_word_embeddings or "lm_head.weight" in weights:
        head = dense_float32(weights.get("lm_head.weight", (c.vocab_size, c.hidden_size)))
    layers = [
        {key: array.astype(dtype) for key, array in load_layer(weights, c, i).items()}
        for i in range(c.num_layers)
    ]
    extra = c.padded_vocab_size - c.vocab_size  # zero rows so that tp devices split the vocabulary

    def padded(rows: np.ndarray) -> np.ndarray:
        return np.pad(rows, ((0, extra), (0, 0))).astype(dtype) if extra else rows.astype(dtype)

    embed = padded(embed)
    return {
        "embed": embed,
        "lm_head": embed if head is embed else padded(head),
        "norm": dense_float32(weights.get("model.norm.weight", (c.hidden_size,))).astype(dtype),
        "layers": layers,
    }


def rope_table(checkpoint: Any, c: JaxLlamaConfig) -> np.ndarray:
    """float32 [max_position, rotary_dim]: cos then sin of position * f_i, with the checkpoint's
    explicit frequencies (GGUF rope_freqs) when it has them, else rope_theta and rope_scaling, as the
    PyTorch model builds it (kiln.models.layers.rotary)."""
    inv_freq = getattr(checkpoint, "rope_inv_freq", None)
    mc = checkpoint.config
    if inv_freq is not None:
        angles = torch.arange(c.max_position, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
        table = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
    else:
        table = kiln.ops.rope_cos_sin_cache(
            c.rotary_dim, c.max_position, mc.rope_theta, mc.rope_scaling, torch.float32, None
        )
    return table.numpy()
