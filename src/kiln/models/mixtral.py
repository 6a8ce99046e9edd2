"""Mixtral (sparse mixture-of-experts Llama) and the pieces the other MoE models share.

    per layer:  h, r = rms_norm(h, r);  h = attn(h);  h, r = rms_norm(h, r);  h = moe(h)
    moe(x) = sum_{j < top_k} w_j(x) * expert_{e_j(x)}(x)   with (w, e) = moe_route(x @ W_router^T)
Attention, norms, rotary, embedding and LM head are the Llama family's (kiln.models.llama / layers);
only the MLP differs. Experts are kept stacked, `w_gate_up [E, 2I, hidden]` (gate rows then up rows)
and `w_down [E, hidden, I]`, the layout `kiln.ops.fused_moe` takes.

Checkpoint names (HF): `model.layers.{i}.block_sparse_moe.gate.weight` [E, hidden] (the router) and
`...block_sparse_moe.experts.{e}.w1|w3|w2.weight` (gate, up, down); or transformers-5's
`model.layers.{i}.mlp.gate.weight` with stacked `...mlp.experts.gate_up_proj` / `...mlp.experts.down_proj`.
"""

from __future__ import annotations

import dataclasses

import torch

import kiln.ops
from kiln.models.config import ModelConfig
from kiln.models.layers import Linear, PagedAttention, RotaryEmbedding
from kiln.models.layers.torch_ops import op
from kiln.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kiln.models.weights import GGUFWeight, Weight, WeightStore

EXPERT_FORMATS = (None, "fp8")


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    return weight.dequantize(dtype) if isinstance(weight, GGUFWeight) else weight.to(dtype)


def load_experts(
    weights: WeightStore,
    prefix: str,
    names: tuple[str, str, str],
    num_experts: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate_up [E, 2I, hidden], w_down [E, hidden, I]) in `dtype`, from per-expert matrices
    `{prefix}experts.{e}.{gate|up|down}.weight`, or stacked `{prefix}experts.gate_up_proj` / `down_proj`."""
    if prefix + "experts.gate_up_proj" in weights:
        gate_up = weights.get(prefix + "experts.gate_up_proj", (num_experts, 2 * inter, hidden))
        down = weights.get(prefix + "experts.down_proj", (num_experts, hidden, inter))
        return gate_up.to(dtype), down.to(dtype)
    gate, up, down = names
    gate_up = torch.empty((num_experts, 2 * inter, hidden), dtype=dtype)
    w_down = torch.empty((num_experts, hidden, inter), dtype=dtype)
    for e in range(num_experts):
        p = f"{prefix}experts.{e}."
        gate_up[e, :inter] = _dense(weights.get(p + f"{gate}.weight", (inter, hidden)), dtype)
        gate_up[e, inter:] = _dense(weights.get(p + f"{up}.weight", (inter, hidden)), dtype)
        w_down[e] = _dense(weights.get(p + f"{down}.weight", (hidden, inter)), dtype)
    return gate_up, w_down


class SparseMoE(torch.nn.Module):
    """x [T, hidden] -> [T, hidden]: route each token to its top-k experts and mix their SwiGLU outputs.

    router: [E, hidden]; w_gate_up: [E, 2I, hidden]; w_down: [E, hidden, I]. Router logits are computed
    in the model dtype, scores in float32 (`kiln.ops.moe_route`), the experts by `kiln.ops.fused_moe`.
    expert_format: None keeps the experts in the model dtype; "fp8" stores them as per-expert-scaled
    float8_e4m3fn (half the memory and weight traffic of bf16: Mixtral-8x7B's experts fit one 80 GB GPU).
    """

    def __init__(
        self,
        router: Weight,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        *,
        top_k: int,
        renormalize: bool,
        device: torch.device,
        dtype: torch.dtype,
        expert_format: str | None = None,
    ):
        super().__init__()
        if expert_format not in EXPERT_FORMATS:
            raise ValueError(
                f"SparseMoE: expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}"
            )
        self.router = Linear(router, None, device=device, dtype=dtype)
        self.w_gate_up_scale = self.w_down_scale = None
        if (
            expert_format == "fp8"
        ):  # quantized where the weights are, so full-width copies never reach the GPU
            w_gate_up, self.w_gate_up_scale = kiln.ops.quantize_experts_fp8(w_gate_up)
            w_down, self.w_down_scale = kiln.ops.quantize_experts_fp8(w_down)
            self.w_gate_up_scale = self.w_gate_up_scale.to(device)
            self.w_down_scale = self.w_down_scale.to(device)
        else:
            w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
        self.w_gate_up = w_gate_up.to(device).contiguous()
        self.w_down = w_down.to(device).contiguous()
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = kiln.ops.moe_route(self.router(x), self.top_k, self.renormalize)
        return kiln.ops.fused_moe(
            x, self.w_gate_up, self.w_down, topk_weights, topk_ids, self.w_gate_up_scale, self.w_down_scale
        )


def build_attention(
    config: ModelConfig, index: int, weights: WeightStore, rotary: RotaryEmbedding, opts: dict
) -> PagedAttention:
    """Layer `index`'s self-attention, exactly as the Llama family builds it."""
    c, p = config, f"model.layers.{index}.self_attn."
    hidden, q_size, kv_size = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    bias = None
    if c.attention_bias:
        bias = [
            weights.get(p + f"{n}_proj.bias", (s,))
            for n, s in (("q", q_size), ("k", kv_size), ("v", kv_size))
        ]
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
        device=opts["device"],
        dtype=opts["dtype"],
        cpu_format=opts["cpu_format"],
    )


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer (same norms, attention and forward) around a given MLP module."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        weights: WeightStore,
        rotary: RotaryEmbedding,
        opts: dict,
        mlp: torch.nn.Module,
    ):
        torch.nn.Module.__init__(self)  # LlamaDecoderLayer.__init__ would load a dense MLP
        hidden, p = config.hidden_size, f"model.layers.{index}."
        device, dtype = opts["device"], opts["dtype"]
        self.input_layernorm = weights.get(p + "input_layernorm.weight", (hidden,)).to(device, dtype)
        self.post_attention_layernorm = weights.get(p + "post_attention_layernorm.weight", (hidden,)).to(
            device, dtype
        )
        self.self_attn = build_attention(config, index, weights, rotary, opts)
        self.mlp = mlp
        self.eps = config.rms_norm_eps
        self._rms_norm = op("rms_norm")


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose layers come from `build_layer` (MoE models override it).

    Same constructor, forward and compute_logits as LlamaForCausalLM: the embedding, rotary, final
    norm and LM head are built by it; then the layers are built here. `expert_format="fp8"` keeps the
    routed experts in FP8 (see SparseMoE).
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
        expert_format: str | None = None,
    ):
        config = self.adjust_config(config)
        super().__init__(
            dataclasses.replace(config, num_layers=0),
            weights,
            device=device,
            dtype=dtype,
            cpu_format=cpu_format,
            lm_head_format=lm_head_format,
            rope_inv_freq=rope_inv_freq,
        )
        self.config = config
        opts = {
            "device": torch.device(device),
            "dtype": dtype,
            "cpu_format": cpu_format,
            "expert_format": expert_format,
        }
        self.layers = torch.nn.ModuleList(
            self.build_layer(config, i, weights, opts) for i in range(config.num_layers)
        )

    @classmethod
    def adjust_config(cls, config: ModelConfig) -> ModelConfig:
        return config

    def build_layer(
        self, config: ModelConfig, index: int, weights: WeightStore, opts: dict
    ) -> torch.nn.Module:
        raise NotImplementedError


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral-8x7B / 8x22B: every layer sparse, softmax routing over `num_local_experts`, top
    `num_experts_per_tok`, weights renormalized over the chosen experts."""

    def build_layer(self, config, index, weights, opts):
        extra, hidden, inter = config.extra, config.hidden_size, config.intermediate_size
        num_experts = int(extra["num_local_experts"])
        prefix = f"model.layers.{index}.block_sparse_moe."
        if prefix + "gate.weight" not in weights:  # transformers-5 names
            prefix = f"model.layers.{index}.mlp."
        w_gate_up, w_down = load_experts(
            weights, prefix, ("w1", "w3", "w2"), num_experts, hidden, inter, opts["dtype"]
        )
        moe = SparseMoE(
            weights.get(prefix + "gate.weight", (num_experts, hidden)),
            w_gate_up,
            w_down,
            top_k=int(extra["num_experts_per_tok"]),
            renormalize=True,
            device=opts["device"],
            dtype=opts["dtype"],
            expert_format=opts["expert_format"],
        )
        return MoeDecoderLayer(config, index, weights, self.rotary, opts, moe)
