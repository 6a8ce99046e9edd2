"""Mixtral (sparse mixture-of-experts Llama) and the pieces the other MoE models share.

    per layer:  h, r = rms_norm(h, r);  h = attn(h);  h, r = rms_norm(h, r);  h = moe(h)
    moe(x) = sum_{j < top_k} w_j(x) * expert_{e_j(x)}(x)   with (w, e) = moe_route(x @ W_router^T)
Attention, norms, rotary, embedding and LM head are the Llama family's (kiln.models.llama / layers);
only the MLP differs: the model passes `build_mixtral_moe` as its `build_mlp`, and each
`DecoderLayer(attn, mlp)` gets a SparseMoE. Experts are kept stacked, `w_gate_up [E, 2I, hidden]`
(gate rows then up rows) and `w_down [E, hidden, I]`, the layout `kiln.ops.fused_moe` takes.

Checkpoint names (HF): `model.layers.{i}.block_sparse_moe.gate.weight` [E, hidden] (the router) and
`...block_sparse_moe.experts.{e}.w1|w3|w2.weight` (gate, up, down); or transformers-5's
`model.layers.{i}.mlp.gate.weight` with stacked `...mlp.experts.gate_up_proj` / `...mlp.experts.down_proj`.
"""

from __future__ import annotations

import functools

import torch

import kiln.ops
from kiln.models.config import ModelConfig
from kiln.models.layers import Linear
from kiln.models.llama import LayerOptions, LlamaForCausalLM
from kiln.models.weights import GGUFWeight, Weight, WeightStore

EXPERT_FORMATS = (None, "fp8")


def check_expert_format(expert_format: str | None) -> str | None:
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
    return expert_format


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
        check_expert_format(expert_format)
        self.router = Linear(router, None, device=device, dtype=dtype)
        self.w_gate_up_scale = self.w_down_scale = None
        if expert_format == "fp8":
            # quantized where the weights are, so full-width copies never reach the GPU
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


def build_mixtral_moe(
    config: ModelConfig, index: int, weights: WeightStore, opts: LayerOptions, *, expert_format: str | None
) -> SparseMoE:
    """Layer `index`'s sparse MLP: softmax routing over `num_local_experts`, top `num_experts_per_tok`,
    weights renormalized over the chosen experts."""
    extra, hidden, inter = config.extra, config.hidden_size, config.intermediate_size
    num_experts = int(extra["num_local_experts"])
    prefix = f"model.layers.{index}.block_sparse_moe."
    if prefix + "gate.weight" not in weights:  # transformers-5 names
        prefix = f"model.layers.{index}.mlp."
    w_gate_up, w_down = load_experts(
        weights, prefix, ("w1", "w3", "w2"), num_experts, hidden, inter, opts.dtype
    )
    return SparseMoE(
        weights.get(prefix + "gate.weight", (num_experts, hidden)),
        w_gate_up,
        w_down,
        top_k=int(extra["num_experts_per_tok"]),
        renormalize=True,
        device=opts.device,
        dtype=opts.dtype,
        expert_format=expert_format,
    )


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral-8x7B / 8x22B: a Llama-family model whose every MLP is a SparseMoE.

    Same arguments as LlamaForCausalLM, plus expert_format: None keeps the routed experts in the model
    dtype, "fp8" in FP8 (see SparseMoE).
    """

    def __init__(
        self, config: ModelConfig, weights: WeightStore, *, expert_format: str | None = None, **kwargs
    ):
        build_mlp = functools.partial(build_mixtral_moe, expert_format=check_expert_format(expert_format))
        super().__init__(config, weights, build_mlp=build_mlp, **kwargs)
