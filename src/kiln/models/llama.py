"""The Llama family: Llama 2/3 (incl. Llama-3 rope scaling), SmolLM2, Mistral (sliding window) and
Qwen2 (q/k/v biases, tied embeddings), one implementation with config switches.

    h = embed(input_ids)
    for each layer:  h, r = rms_norm(h, r);  h = attn(h);  h, r = rms_norm(h, r);  h = mlp(h)
    out = rms_norm(h, r)                      (r: the residual stream, updated in place by rms_norm)
    logits = out @ W_lm^T                     (W_lm = the embedding when tied)

Weights come from a WeightStore under HF names (GGUF names are mapped by the GGUF loader).
"""

from __future__ import annotations

import torch

from kiln.models.attention_metadata import AttentionMetadata
from kiln.models.config import ModelConfig
from kiln.models.layers import GatedMLP, Linear, PagedAttention, RotaryEmbedding, VocabEmbedding
from kiln.models.layers.torch_ops import op
from kiln.models.weights import WeightStore


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(
        self, config: ModelConfig, index: int, weights: WeightStore, rotary: RotaryEmbedding, opts: dict
    ):
        super().__init__()
        c, p = config, f"model.layers.{index}."
        hidden, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        device, dtype = opts["device"], opts["dtype"]
        bias = None
        if c.attention_bias:
            bias = [
                weights.get(p + f"self_attn.{name}_proj.bias", (size,))
                for name, size in (("q", q_size), ("k", kv_size), ("v", kv_size))
            ]
        self.input_layernorm = weights.get(p + "input_layernorm.weight", (hidden,)).to(device, dtype)
        self.post_attention_layernorm = weights.get(p + "post_attention_layernorm.weight", (hidden,)).to(
            device, dtype
        )
        self.self_attn = PagedAttention(
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            q=weights.get(p + "self_attn.q_proj.weight", (q_size, hidden)),
            k=weights.get(p + "self_attn.k_proj.weight", (kv_size, hidden)),
            v=weights.get(p + "self_attn.v_proj.weight", (kv_size, hidden)),
            o=weights.get(p + "self_attn.o_proj.weight", (hidden, q_size)),
            qkv_bias=bias,
            rotary=rotary,
            sliding_window=c.layer_sliding_window(index),
            device=device,
            dtype=dtype,
            cpu_format=opts["cpu_format"],
        )
        self.mlp = GatedMLP(
            weights.get(p + "mlp.gate_proj.weight", (c.intermediate_size, hidden)),
            weights.get(p + "mlp.up_proj.weight", (c.intermediate_size, hidden)),
            weights.get(p + "mlp.down_proj.weight", (hidden, c.intermediate_size)),
            device=device,
            dtype=dtype,
            cpu_format=opts["cpu_format"],
        )
        self.eps = c.rms_norm_eps
        self._rms_norm = op("rms_norm", device)

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata):
        """hidden, residual [T, hidden]; residual None on the first layer. Returns (hidden, residual)."""
        if residual is None:
            residual = hidden
            hidden = self._rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = self._rms_norm(hidden, self.input_layernorm, self.eps, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden, residual = self._rms_norm(hidden, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(torch.nn.Module):
    """Inference-only Llama-family model over a paged KV cache.

    forward(input_ids int64 [T], positions int64 [T], kv_caches: one (key_cache, value_cache) per layer,
            attn_metadata) -> hidden [T, hidden_size] in model.dtype
    compute_logits(hidden [N, hidden_size]) -> float32 [N, vocab_size]

    dtype: activation dtype (float32 on CPU by default); kv_cache_dtype: what the engine should allocate.
    cpu_format: how CPU linear weights are kept ("int4" for GGUF Q4 weights, else "fp32"/"fp16"/"bf16");
    lm_head_format: the same for the LM head.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: WeightStore,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        cpu_format: str | None = None,
        lm_head_format: str | None = None,
        rope_inv_freq: torch.Tensor | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.kv_cache_dtype = dtype
        self.device = device
        opts = {"device": device, "dtype": dtype, "cpu_format": cpu_format}
        c = config
        embed = weights.get("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.embed_tokens = VocabEmbedding(embed, device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(
            c.head_dim,
            c.max_position_embeddings,
            c.rope_theta,
            c.rope_scaling,
            device,
            inv_freq=rope_inv_freq,
        )
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(c, i, weights, self.rotary, opts) for i in range(c.num_layers)
        )
        self.norm = weights.get("model.norm.weight", (c.hidden_size,)).to(device, dtype)
        head = embed
        if not c.tie_word_embeddings or "lm_head.weight" in weights:
            head = weights.get("lm_head.weight", (c.vocab_size, c.hidden_size))
        self.lm_head = Linear(head, None, device=device, dtype=dtype, cpu_format=lm_head_format or cpu_format)
        self.eps = c.rms_norm_eps
        self._rms_norm = op("rms_norm", device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"{type(self).__name__}.forward: got {len(kv_caches)} kv_caches, expected one per layer "
                f"({len(self.layers)})"
            )
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        hidden, _ = self._rms_norm(hidden, self.norm, self.eps, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
