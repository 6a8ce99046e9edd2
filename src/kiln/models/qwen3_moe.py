"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm before RoPE,
kiln.models.qwen3) with Mixtral-style routed experts and no shared expert.

    moe(x) = sum_{j < top_k} w_j(x) * expert_{e_j(x)}(x),   (w, e) = top-k of softmax(x @ W_router^T)
with `num_experts` experts of `moe_intermediate_size`, top `num_experts_per_tok` (Qwen3-30B-A3B: 128
experts, top 8), the chosen weights renormalized to sum to 1 when `norm_topk_prob` (true in every
released Qwen3-MoE). Layer i is sparse unless i is in `mlp_only_layers` or (i + 1) %
`decoder_sparse_step` != 0; dense layers have a plain SwiGLU MLP of `intermediate_size`. Experts are
kept stacked for `kiln.ops.fused_moe` (kiln.models.mixtral.SparseMoE), split over ranks like Mixtral's
under tensor or expert parallelism.

Checkpoint names (HF): `model.layers.{i}.mlp.gate.weight` [E, hidden] (the router) and per-expert
`...mlp.experts.{e}.{gate,up,down}_proj.weight`, or transformers-5's stacked
`...mlp.experts.gate_up_proj` / `...mlp.experts.down_proj`.
"""

from __future__ import annotations

import functools

import torch

from kiln.models.config import ModelConfig
from kiln.models.llama import LayerOptions, build_gated_mlp
from kiln.models.mixtral import SparseMoE, check_expert_format, load_experts, rank_expert_shard
from kiln.models.qwen3 import Qwen3ForCausalLM
from kiln.models.weights import WeightStore


def num_experts(config: ModelConfig) -> int:
    """The routed expert count: `num_experts` (Qwen's config.json), or `num_local_experts` (the name
    transformers 5's save_pretrained writes it under)."""
    extra = config.extra
    return int(extra.get("num_experts", extra.get("num_local_experts")) or 0)


def is_sparse_layer(config: ModelConfig, index: int) -> bool:
    """Whether layer `index` has routed experts (HF's rule, shared by Qwen2-MoE and Qwen3-MoE)."""
    extra = config.extra
    return (
        index not in (extra.get("mlp_only_layers") or [])
        and num_experts(config) > 0
        and (index + 1) % int(extra.get("decoder_sparse_step", 1)) == 0
    )


def build_qwen3_moe_mlp(
    config: ModelConfig, index: int, weights: WeightStore, opts: LayerOptions, *, expert_format: str | None
) -> torch.nn.Module:
    """Layer `index`'s MLP: a SparseMoE where the config makes the layer sparse, else the dense gated
    MLP of `intermediate_size`."""
    if not is_sparse_layer(config, index):
        return build_gated_mlp(config, index, weights, opts)
    extra, hidden = config.extra, config.hidden_size
    shard = rank_expert_shard(config, weights, opts)
    experts, inter = shard.num_experts, shard.full_intermediate
    prefix = f"model.layers.{index}.mlp."
    w_gate_up, w_down = load_experts(
        weights, prefix, ("gate_proj", "up_proj", "down_proj"), experts, hidden, inter, opts.dtype, shard
    )
    return SparseMoE(
        weights.get(prefix + "gate.weight", (experts, hidden)),
        w_gate_up,
        w_down,
        top_k=int(extra["num_experts_per_tok"]),
        renormalize=bool(extra.get("norm_topk_prob", False)),
        device=opts.device,
        dtype=opts.dtype,
        expert_format=expert_format,
        tp_group=opts.tp_group,
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3ForCausalLM whose MLPs come from build_qwen3_moe_mlp. Same arguments as
    LlamaForCausalLM, plus expert_format (None: experts in the model dtype; "fp8": see SparseMoE)."""

    def __init__(
        self, config: ModelConfig, weights: WeightStore, *, expert_format: str | None = None, **kwargs
    ):
        build_mlp = functools.partial(build_qwen3_moe_mlp, expert_format=check_expert_format(expert_format))
        super().__init__(config, weights, build_mlp=build_mlp, **kwargs)
