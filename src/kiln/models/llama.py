"""The Llama family: Llama 2/3 (incl. Llama-3 rope scaling), SmolLM2, Mistral (sliding window) and
Qwen2 (q/k/v biases, tied embeddings), one implementation with config switches.

    h = embed(input_ids)
    for each layer:  h, r = rms_norm(h, r);  h = attn(h);  h, r = rms_norm(h, r);  h = mlp(h)
    out = rms_norm(h, r)                      (r: the residual stream, updated in place by rms_norm)
    logits = out @ W_lm^T                     (W_lm = the embedding when tied)

A decoder layer is built from its parts, `DecoderLayer(attn, mlp, ...)`: the MLP is the dense gated
MLP here, a mixture of experts in the MoE models (kiln.models.mixtral, qwen2_moe), which pass their
own `build_mlp`. Weights come from a WeightStore under HF names (GGUF names are mapped by the GGUF
loader). With a `tp_group` the model holds this rank's shard (kiln.models.sharding): its heads, MLP
columns and vocabulary rows, with the communicating layers built as such.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kiln.ops
from kiln.models.attention_metadata import AttentionMetadata
from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.layers import (
    GatedMLP,
    PagedAttention,
    ParallelLMHead,
    RotaryEmbedding,
    TPGroup,
    VocabParallelEmbedding,
)
from kiln.models.sharding import ShardedWeightStore, ShardPlan
from kiln.models.weights import WeightStore

# config.json hidden_act names of SiLU (transformers' ACT2FN)
SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True)
class LayerOptions:
    """How a model's layers are built: device, activation dtype, CPU weight format (see
    kiln.models.layers.linear) and tensor-parallel group (None = one process)."""

    device: torch.device
    dtype: torch.dtype
    cpu_format: str | None = None
    tp_group: TPGroup | None = None


# (config, layer index, weights, options) -> the layer's MLP module, x [T, hidden] -> [T, hidden]
MlpBuilder = Callable[[ModelConfig, int, WeightStore, LayerOptions], torch.nn.Module]
# (config, layer index, weights, rotary, options) -> the layer's self-attention
AttentionBuilder = Callable[[ModelConfig, int, WeightStore, RotaryEmbedding, LayerOptions], PagedAttention]


def build_attention(
    config: ModelConfig,
    index: int,
    weights: WeightStore,
    rotary: RotaryEmbedding,
    opts: LayerOptions,
    *,
    qk_norm: bool = False,
) -> PagedAttention:
    """Layer `index`'s self-attention (`model.layers.{index}.self_attn.*`), with config's head counts.
    qk_norm: also read `self_attn.{q,k}_norm.weight` [head_dim] and RMSNorm each q / k head before
    RoPE (Qwen3)."""
    c, p = config, f"model.layers.{index}.self_attn."
    hidden, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    bias = None
    if c.attention_bias:
        bias = [
            weights.get(p + f"{name}_proj.bias", (size,))
            for name, size in (("q", q_size), ("k", kv_size), ("v", kv_size))
        ]
    qk_norm_weights = None
    if qk_norm:
        qk_norm_weights = tuple(
            weights.get(p + f"{name}_norm.weight", (c.head_dim,)).to(opts.device, opts.dtype) for name in "qk"
        )
    return PagedAttention(
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        q=weights.get(p + "q_proj.weight", (q_size, hidden)),
        k=weights.get(p + "k_proj.weight", (kv_size, hidden)),
        v=weights.get(p + "v_proj.weight", (kv_size, hidden)),
        o=weights.get(p + "o_proj.weight", (hidden, q_size)),
        qkv_bias=bias,
        rotary=rotary,
        sliding_window=c.layer_sliding_window(index),
        device=opts.device,
        dtype=opts.dtype,
        cpu_format=opts.cpu_format,
        tp_group=opts.tp_group,
        qk_norm=qk_norm_weights,
        qk_norm_eps=c.rms_norm_eps,
        # transformers' Llama with attention_bias has one on o_proj too (Qwen2 does not)
        o_bias=weights.get_optional(p + "o_proj.bias", (hidden,)) if c.attention_bias else None,
    )


def build_gated_mlp(config: ModelConfig, index: int, weights: WeightStore, opts: LayerOptions) -> GatedMLP:
    """Layer `index`'s dense SwiGLU MLP (`model.layers.{index}.mlp.{gate,up,down}_proj`)."""
    p, hidden, inter = f"model.layers.{index}.mlp.", config.hidden_size, config.intermediate_size
    biases = None
    if config.extra.get("mlp_bias"):  # transformers' LlamaConfig.mlp_bias
        biases = tuple(
            weights.get(p + f"{name}_proj.bias", (size,))
            for name, size in (("gate", inter), ("up", inter), ("down", hidden))
        )
    return GatedMLP(
        weights.get(p + "gate_proj.weight", (inter, hidden)),
        weights.get(p + "up_proj.weight", (inter, hidden)),
        weights.get(p + "down_proj.weight", (hidden, inter)),
        device=opts.device,
        dtype=opts.dtype,
        cpu_format=opts.cpu_format,
        tp_group=opts.tp_group,
        biases=biases,
    )


class DecoderLayer(torch.nn.Module):
    """A pre-norm decoder layer around the attention and MLP it is given (dense or MoE).

    input_layernorm, post_attention_layernorm: RMSNorm weights [hidden] in the activation dtype.
    """

    def __init__(
        self,
        attn: PagedAttention,
        mlp: torch.nn.Module,
        input_layernorm: torch.Tensor,
        post_attention_layernorm: torch.Tensor,
        eps: float,
    ):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.eps = eps

    def forward(self, positions, hidden, residual, kv_cache, attn_metadata):
        """hidden, residual [T, hidden]; residual None on the first layer. Returns (hidden, residual)."""
        if residual is None:
            residual = hidden
            hidden = kiln.ops.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = kiln.ops.rms_norm(hidden, self.input_layernorm, self.eps, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, attn_metadata)
        hidden, residual = kiln.ops.rms_norm(hidden, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(hidden), residual


def build_decoder_layer(
    config: ModelConfig,
    index: int,
    weights: WeightStore,
    rotary: RotaryEmbedding,
    opts: LayerOptions,
    mlp: torch.nn.Module,
    build_attn: AttentionBuilder = build_attention,
) -> DecoderLayer:
    """Layer `index` of a Llama-family checkpoint (its norms and the attention `build_attn` makes)
    around `mlp`."""
    p, hidden = f"model.layers.{index}.", config.hidden_size
    return DecoderLayer(
        build_attn(config, index, weights, rotary, opts),
        mlp,
        weights.get(p + "input_layernorm.weight", (hidden,)).to(opts.device, opts.dtype),
        weights.get(p + "post_attention_layernorm.weight", (hidden,)).to(opts.device, opts.dtype),
        config.rms_norm_eps,
    )


def build_lm_head(
    config: ModelConfig,
    weights: WeightStore,
    embed,
    local_vocab: int,
    vocab_sizes,
    device: torch.device,
    dtype: torch.dtype,
    cpu_format: str | None,
    tp_group: TPGroup | None,
) -> ParallelLMHead:
    """The LM head over this rank's vocabulary rows: `lm_head.weight` [local_vocab, hidden], or the
    embedding `embed` when the checkpoint ties them and stores no head."""
    head = embed
    if not config.tie_word_embeddings or "lm_head.weight" in weights:
        head = weights.get("lm_head.weight", (local_vocab, config.hidden_size))
    return ParallelLMHead(
        head, device=device, dtype=dtype, cpu_format=cpu_format, vocab_sizes=vocab_sizes, tp_group=tp_group
    )


class LlamaForCausalLM(torch.nn.Module):
    """Inference-only Llama-family model over a paged KV cache.

    forward(input_ids int64 [T], positions int64 [T], kv_caches: one (key_cache, value_cache) per layer,
            attn_metadata) -> hidden [T, hidden_size] in model.dtype
    compute_logits(hidden [N, hidden_size]) -> float32 [N, vocab_size] (under tensor parallelism: on
            rank 0; the other ranks get their vocabulary slice)

    dtype: activation dtype (float32 on CPU by default); kv_cache_dtype: what the engine should allocate.
    cpu_format: how CPU linear weights are kept (kiln.ops.gemm.weight_formats.CPU_WEIGHT_FORMATS);
    lm_head_format: the same for the LM head.
    tp_group: build this rank's shard of the model (`weights` are the whole checkpoint's; each tensor is
    sliced as it is read). model.config then has the rank's head and intermediate sizes (the KV cache
    is per rank) but the full vocab_size.
    build_mlp: each layer's MLP (MoE models pass theirs).
    build_attn: each layer's self-attention (Qwen3 passes build_attention with its q/k norms).
    pipeline_layers: (start, end): build only decoder layers [start, end) (a pipeline stage,
    kiln.models.sharding.pipeline_stages), the embedding only when start == 0, the final norm and LM
    head only when end == num_layers; model.config.num_layers is then end - start (one KV cache per
    layer held) and the stage runs embed / forward_layers / final_norm instead of forward.
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
        build_mlp: MlpBuilder = build_gated_mlp,
        build_attn: AttentionBuilder = build_attention,
        pipeline_layers: tuple[int, int] | None = None,
    ):
        super().__init__()
        if config.hidden_act not in SILU_NAMES:  # every MLP here (dense, experts) is SwiGLU
            raise ModelLoadError(
                f"{weights.source}: hidden_act {config.hidden_act!r} is not supported by "
                f"{type(self).__name__}, whose MLPs are SwiGLU (expected one of {', '.join(SILU_NAMES)})"
            )
        kinds = set(config.layer_types or ()) - {"full_attention", "sliding_attention"}
        if kinds:  # e.g. linear or chunked attention: not a Llama-family layer
            raise ModelLoadError(
                f"{weights.source}: layer_types {sorted(map(str, kinds))} are not supported by "
                f"{type(self).__name__} (it runs full_attention and sliding_attention layers)"
            )
        # set by a CPU ModelRunner: one-token eager decode steps as one loop (kiln.models.cpu_flat_decode)
        self.flat_decode = None
        device = torch.device(device)
        start, end = pipeline_layers or (0, config.num_layers)
        if not 0 <= start < end <= config.num_layers:
            raise ValueError(
                f"{type(self).__name__}: pipeline_layers={pipeline_layers}, expected 0 <= start < end <= "
                f"num_layers={config.num_layers}"
            )
        self.pipeline_layers = (start, end)
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
        embed, self.embed_tokens = None, None
        if start == 0 or (end == c.num_layers and c.tie_word_embeddings and "lm_head.weight" not in weights):
            embed = weights.get("model.embed_tokens.weight", (local_vocab, c.hidden_size))
        if start == 0:
            self.embed_tokens = VocabParallelEmbedding(
                embed, device=device, dtype=dtype, vocab_start=vocab_start, tp_group=tp_group
            )
        self.rotary = RotaryEmbedding(
            c.rotary_dim or c.head_dim,
            c.max_position_embeddings,
            c.rope_theta,
            c.rope_scaling,
            device,
            inv_freq=rope_inv_freq,
        )
        self.layers = torch.nn.ModuleList(
            build_decoder_layer(c, i, weights, self.rotary, opts, build_mlp(c, i, weights, opts), build_attn)
            for i in range(start, end)
        )
        self.norm, self.lm_head = None, None
        if end == c.num_layers:
            self.norm = weights.get("model.norm.weight", (c.hidden_size,)).to(device, dtype)
            self.lm_head = build_lm_head(
                c,
                weights,
                embed,
                local_vocab,
                vocab_sizes,
                device,
                dtype,
                lm_head_format or cpu_format,
                tp_group,
            )
        self.eps = c.rms_norm_eps
        if end - start != c.num_layers:  # a stage: the engine allocates KV caches for its layers only
            self.config = dataclasses.replace(c, num_layers=end - start)

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
        hidden, residual = self.forward_layers(
            positions, self.embed_tokens(input_ids), None, kv_caches, attn_metadata
        )
        return self.final_norm(hidden, residual)

    def forward_layers(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers this model holds: hidden, residual [T, hidden] (residual None before the
        first layer) -> (hidden, residual) after the last; kv_caches: one per held layer."""
        flat = self.flat_decode
        if flat is not None and flat.applies(hidden, kv_caches, attn_metadata):
            return flat(positions, hidden, residual, kv_caches, attn_metadata)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """rms_norm(hidden + residual) with the final norm: [T, hidden] -> [T, hidden]."""
        hidden, _ = kiln.ops.rms_norm(hidden, self.norm, self.eps, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
