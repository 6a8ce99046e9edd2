"""Gemma 3 (text: Gemma3ForCausalLM; the language model of the 4B/12B/27B multimodal checkpoints
has the same layers).

    h = embed(input_ids) * sqrt(hidden)                 (the scale rounded to the model dtype, as HF)
    per layer:  a = attn(norm_in(h));  h = h + norm_post_attn(a)
                m = mlp(norm_pre_ff(h));  h = h + norm_post_ff(m)
    logits = final_softcap(norm(h) @ W_lm^T)            (W_lm = the embedding, tied)
where every norm is Gemma's RMSNorm y = x / rms(x) * (1 + w) (kiln.ops.rms_norm with
weight_offset=1: the 1 is added in float32, so bfloat16 weights near 0 stay exact) and the MLP is
GeGLU, down(gelu_tanh(gate(x)) * up(x)). Attention: queries and keys get a per-head Gemma RMSNorm
(q_norm, k_norm over head_dim) before RoPE; scores are scaled by query_pre_attn_scalar ** -0.5.
(Gemma 3 configs carry attn_logit_softcapping, null in the released ones; transformers' Gemma 3
never applies it and llama.cpp's converter refuses it, so it is not applied here either: Gemma 2's
attention soft-capping is gone in Gemma 3. final_logit_softcapping is applied.) Layers alternate
between sliding-window (local) and global attention (config.layer_types; 5 local : 1 global in the
released models), each kind with its own RoPE: local layers rope_local_base_freq unscaled, global
layers rope_theta with rope_scaling. All layers share one paged KV cache; a local layer only masks
keys older than its window (the engine keeps the whole context's blocks).

The residual stream is carried like Llama's: a layer returns (its post-feedforward output, the
stream before adding it), and the next rms_norm with `residual` adds and normalizes in one kernel.
Under tensor parallelism the sharding is Llama's (heads, MLP columns, vocabulary); the norms are
replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

import kiln.ops
from kiln.models.attention_metadata import AttentionMetadata
from kiln.models.config import HF_DEFAULTS, ModelConfig, ModelLoadError
from kiln.models.layers import (
    GatedMLP,
    PagedAttention,
    RotaryEmbedding,
    TPGroup,
    VocabParallelEmbedding,
)
from kiln.models.llama import LayerOptions, LlamaForCausalLM, build_lm_head
from kiln.models.sharding import ShardedWeightStore, ShardPlan
from kiln.models.weights import WeightStore

# Gemma's checkpoints store w for the norm scale (1 + w).
NORM_WEIGHT_OFFSET = 1.0
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


@dataclass(frozen=True)
class Gemma3Options:
    """What Gemma 3 reads beyond ModelConfig (from config.extra, under HF's key names).

    query_pre_attn_scalar: scores are scaled by its -0.5 power; sliding_rope_theta: the RoPE base of
    the sliding-window layers (rope_local_base_freq); final_softcap: c in logits -> c * tanh(logits / c)
    (final_logit_softcapping; None = off). A key absent from config.extra takes Gemma3TextConfig's
    default (kiln.models.config.HF_DEFAULTS: query_pre_attn_scalar 256, whatever head_dim is).
    """

    query_pre_attn_scalar: float
    sliding_rope_theta: float
    final_softcap: float | None

    @classmethod
    def from_config(cls, config: ModelConfig, source: str = "config") -> Gemma3Options:
        """ModelLoadError naming `source` for settings Kiln does not run."""
        extra = config.extra
        if extra.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{source}: use_bidirectional_attention (EmbeddingGemma) is not supported")
        if config.hidden_act not in GELU_TANH_NAMES:
            raise ModelLoadError(
                f"{source}: hidden activation {config.hidden_act!r} is not supported for Gemma 3 "
                f"(expected one of {', '.join(GELU_TANH_NAMES)})"
            )
        if config.layer_types is not None and len(config.layer_types) != config.num_layers:
            raise ModelLoadError(
                f"{source}: layer_types has {len(config.layer_types)} entries, expected one per layer "
                f"({config.num_layers})"
            )

        def positive(key: str, default: Any) -> Any:
            value = extra.get(key, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ModelLoadError(f"{source}: {key!r} is {value!r}, expected a number > 0 or null")
            return float(value)

        defaults = HF_DEFAULTS["Gemma3ForCausalLM"]
        return cls(
            query_pre_attn_scalar=positive("query_pre_attn_scalar", defaults["query_pre_attn_scalar"]),
            sliding_rope_theta=positive("rope_local_base_freq", defaults["rope_local_base_freq"]),
            final_softcap=positive("final_logit_softcapping", None),
        )


class QKNormRotary(torch.nn.Module):
    """Gemma's per-head RMSNorm of queries and keys, then RoPE: the position step PagedAttention runs
    between its QKV projection and the cache write.

    q_norm, k_norm: [head_dim] weights (w of 1 + w) in the activation dtype.
    forward(positions int64 [T], q [T, Hq, D], k [T, Hk, D]) -> (q, k), new tensors, normalized and
    rotated.
    """

    def __init__(self, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float, rotary: RotaryEmbedding):
        super().__init__()
        self.q_norm, self.k_norm, self.eps = q_norm, k_norm, eps
        self.rotary = rotary

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_q, head_dim = q.shape
        num_k = k.shape[1]
        # [T * H, D] rows: one norm per head. q and k are views into the fused QKV output; the norm
        # writes fresh tensors, which RoPE then rotates in place.
        q = kiln.ops.rms_norm(
            q.reshape(num_tokens * num_q, head_dim), self.q_norm, self.eps, weight_offset=NORM_WEIGHT_OFFSET
        ).view(num_tokens, num_q, head_dim)
        k = kiln.ops.rms_norm(
            k.reshape(num_tokens * num_k, head_dim), self.k_norm, self.eps, weight_offset=NORM_WEIGHT_OFFSET
        ).view(num_tokens, num_k, head_dim)
        return self.rotary(positions, q, k)


class Gemma3DecoderLayer(torch.nn.Module):
    """Attention and MLP, each between a pre-norm and a post-norm (four [hidden] Gemma norm weights)."""

    def __init__(
        self,
        attn: PagedAttention,
        mlp: torch.nn.Module,
        norms: dict[str, torch.Tensor],
        eps: float,
    ):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = norms["input_layernorm"]
        self.post_attention_layernorm = norms["post_attention_layernorm"]
        self.pre_feedforward_layernorm = norms["pre_feedforward_layernorm"]
        self.post_feedforward_layernorm = norms["post_feedforward_layernorm"]
        self.eps = eps

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata):
        """hidden, residual [T, hidden]; residual None on the first layer (hidden is then the stream).
        Returns (this layer's post-feedforward output, the stream it has not been added to yet)."""
        offset, eps = NORM_WEIGHT_OFFSET, self.eps
        if residual is None:
            residual = hidden
            hidden = kiln.ops.rms_norm(hidden, self.input_layernorm, eps, weight_offset=offset)
        else:
            hidden, residual = kiln.ops.rms_norm(hidden, self.input_layernorm, eps, residual, offset)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden = kiln.ops.rms_norm(hidden, self.post_attention_layernorm, eps, weight_offset=offset)
        hidden, residual = kiln.ops.rms_norm(hidden, self.pre_feedforward_layernorm, eps, residual, offset)
        hidden = self.mlp(hidden)
        hidden = kiln.ops.rms_norm(hidden, self.post_feedforward_layernorm, eps, weight_offset=offset)
        return hidden, residual


def build_gemma3_layer(
    config: ModelConfig,
    index: int,
    weights: WeightStore,
    rotary: RotaryEmbedding,
    options: Gemma3Options,
    opts: LayerOptions,
) -> Gemma3DecoderLayer:
    """Layer `index` (`model.layers.{index}.*`) with the RoPE of its kind (local or global)."""
    c, p = config, f"model.layers.{index}."
    hidden, d = c.hidden_size, c.head_dim
    q_size, kv_size, inter = c.num_heads * d, c.num_kv_heads * d, c.intermediate_size

    def vector(name: str, size: int) -> torch.Tensor:
        return weights.get(p + name, (size,)).to(opts.device, opts.dtype)

    bias = None
    if c.attention_bias:
        bias = [
            weights.get(p + f"self_attn.{n}_proj.bias", (s,))
            for n, s in (("q", q_size), ("k", kv_size), ("v", kv_size))
        ]
    position = QKNormRotary(
        vector("self_attn.q_norm.weight", d), vector("self_attn.k_norm.weight", d), c.rms_norm_eps, rotary
    )
    attn = PagedAttention(
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=d,
        q=weights.get(p + "self_attn.q_proj.weight", (q_size, hidden)),
        k=weights.get(p + "self_attn.k_proj.weight", (kv_size, hidden)),
        v=weights.get(p + "self_attn.v_proj.weight", (kv_size, hidden)),
        o=weights.get(p + "self_attn.o_proj.weight", (hidden, q_size)),
        qkv_bias=bias,
        o_bias=weights.get_optional(p + "self_attn.o_proj.bias", (hidden,)) if c.attention_bias else None,
        rotary=position,
        sliding_window=c.layer_sliding_window(index),
        device=opts.device,
        dtype=opts.dtype,
        cpu_format=opts.cpu_format,
        tp_group=opts.tp_group,
        scale=options.query_pre_attn_scalar**-0.5,
    )
    mlp = GatedMLP(
        weights.get(p + "mlp.gate_proj.weight", (inter, hidden)),
        weights.get(p + "mlp.up_proj.weight", (inter, hidden)),
        weights.get(p + "mlp.down_proj.weight", (hidden, inter)),
        device=opts.device,
        dtype=opts.dtype,
        cpu_format=opts.cpu_format,
        tp_group=opts.tp_group,
        activation="gelu_tanh",
    )
    names = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )
    norms = {name: vector(f"{name}.weight", hidden) for name in names}
    return Gemma3DecoderLayer(attn, mlp, norms, c.rms_norm_eps)


class Gemma3ForCausalLM(torch.nn.Module):
    """Inference-only Gemma 3 over a paged KV cache; the interface of LlamaForCausalLM.

    forward(input_ids int64 [T], positions int64 [T], kv_caches: one (key_cache, value_cache) per layer,
            attn_metadata) -> hidden [T, hidden_size] in model.dtype
    compute_logits(hidden [N, hidden_size]) -> float32 [N, vocab_size], soft-capped when the config
            says so (under tensor parallelism: on rank 0; the other ranks get their vocabulary slice).
    Arguments as LlamaForCausalLM's; rope_inv_freq (GGUF rope_freqs) applies to the global layers.
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
        tp_group: TPGroup | None = None,
    ):
        super().__init__()
        # set by a CPU ModelRunner: one-token eager decode steps as one loop (kiln.models.cpu_flat_decode)
        self.flat_decode = None
        device = torch.device(device)
        self.options = options = Gemma3Options.from_config(config, weights.source)
        vocab_start, vocab_sizes = 0, None
        if tp_group is not None:
            plan = ShardPlan(config, tp_group.world_size)
            weights = ShardedWeightStore(weights, plan, tp_group.rank)
            vocab_start, vocab_sizes = plan.shards[tp_group.rank].vocab[0], plan.vocab_sizes
            config = dataclasses.replace(plan.rank_config(tp_group.rank), vocab_size=config.vocab_size)
        self.config = c = config
        self.dtype = dtype
        self.kv_cache_dtype = dtype
        self.device = device
        opts = LayerOptions(device, dtype, cpu_format, tp_group)
        local_vocab = c.vocab_size if vocab_sizes is None else vocab_sizes[tp_group.rank]
        embed = weights.get("model.embed_tokens.weight", (local_vocab, c.hidden_size))
        self.embed_tokens = VocabParallelEmbedding(
            embed, device=device, dtype=dtype, vocab_start=vocab_start, tp_group=tp_group
        )
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype.
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=dtype, device=device)
        self.rotary_global = RotaryEmbedding(
            c.head_dim,
            c.max_position_embeddings,
            c.rope_theta,
            c.rope_scaling,
            device,
            inv_freq=rope_inv_freq,
        )
        self.rotary_local = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, options.sliding_rope_theta, None, device
        )
        self.layers = torch.nn.ModuleList(
            build_gemma3_layer(
                c,
                i,
                weights,
                self.rotary_local if c.layer_sliding_window(i) is not None else self.rotary_global,
                options,
                opts,
            )
            for i in range(c.num_layers)
        )
        self.norm = weights.get("model.norm.weight", (c.hidden_size,)).to(device, dtype)
        self.lm_head = build_lm_head(
            c, weights, embed, local_vocab, vocab_sizes, device, dtype, lm_head_format or cpu_format, tp_group
        )
        self.eps = c.rms_norm_eps

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
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        hidden, residual = self.forward_layers(positions, hidden, None, kv_caches, attn_metadata)
        hidden, _ = kiln.ops.rms_norm(hidden, self.norm, self.eps, residual, NORM_WEIGHT_OFFSET)
        return hidden

    # the decoder layers, through the flat loop (self.flat_decode) where it applies: Llama's, as is
    forward_layers = LlamaForCausalLM.forward_layers

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.options.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
