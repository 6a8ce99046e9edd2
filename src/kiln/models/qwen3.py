"""Qwen3 (dense: Qwen3-0.6B .. 32B): a Llama-family decoder whose attention RMS-normalizes every query
and key head before RoPE.

    per layer:  h, r = rms_norm(h, r);  h = attn(h);  h, r = rms_norm(h, r);  h = mlp(h)   (as Llama)
    attn:       q, k, v = split(h @ Wqkv^T);  q, k = rope(rms_norm_per_head(q), rms_norm_per_head(k))
The q / k norm weights (`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, [head_dim]) are shared
by all heads and use `rms_norm_eps`; the norm and the rotation run as one op, `kiln.ops.qk_norm_rope`.
No q/k/v biases (`attention_bias`, default false); `head_dim` comes from the config and need not be
hidden_size / num_attention_heads (Qwen3-0.6B: 1024 / 16 heads, head_dim 128). Tied embeddings
where the config says so. Under tensor parallelism the norms are replicated (they act per head).
GGUF (llama.cpp's "qwen3"): blk.N.attn_q_norm / attn_k_norm, Q/K rows not permuted.
"""

from __future__ import annotations

import functools

from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaForCausalLM, build_attention
from kiln.models.weights import WeightStore

build_qwen3_attention = functools.partial(build_attention, qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: LlamaForCausalLM whose attention has per-head q/k RMSNorm. Same arguments and
    forward / compute_logits as LlamaForCausalLM (MoE variants pass their `build_mlp`)."""

    def __init__(self, config: ModelConfig, weights: WeightStore, **kwargs):
        super().__init__(config, weights, build_attn=build_qwen3_attention, **kwargs)
