"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Mixtral-style routed experts plus a shared expert.

    moe(x) = sum_j w_j(x) * expert_{e_j}(x) + sigmoid(x @ g^T) * shared(x)
with softmax routing over `num_experts`, top `num_experts_per_tok`, renormalized only when
`norm_topk_prob`; `shared` is a dense SwiGLU MLP of `shared_expert_intermediate_size`, gated per token
by `shared_expert_gate` ([1, hidden]). Layer i is sparse unless i is in `mlp_only_layers` or
(i + 1) % `decoder_sparse_step` != 0; dense layers have a plain MLP of `intermediate_size`.
Attention has q/k/v biases (`qkv_bias`, default true), like Qwen2.

Tensor / expert parallelism: the routed experts as Mixtral's (kiln.models.mixtral); the shared expert
is split like a dense MLP (its rows of gate/up, columns of down) and its gate replicated. Under tensor
parallelism the routed and shared partial sums are added before one all-reduce; under expert
parallelism the routed output is already whole and the shared expert's partial sum is all-reduced.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from kiln.models.config import ModelConfig
from kiln.models.layers import GatedMLP, Linear
from kiln.models.layers.tp import all_reduce
from kiln.models.llama import LayerOptions, LlamaForCausalLM, build_gated_mlp
from kiln.models.mixtral import SparseMoE, check_expert_format, load_experts, rank_expert_shard
from kiln.models.weights import WeightStore


class SharedExpertMoE(SparseMoE):
    """SparseMoE plus a sigmoid-gated shared expert that every token goes through.

    shared: the shared expert's GatedMLP over this rank's slice, built without a group (it does not
    all-reduce: forward does, once); shared_gate: [1, hidden], replicated."""

    def __init__(self, *args, shared: GatedMLP, shared_gate: Linear, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared_expert = shared
        self.shared_expert_gate = shared_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.ep > 1:
            return out + all_reduce(shared, self.tp_group)
        return all_reduce(out + shared, self.tp_group)


def _shared_expert(
    weights: WeightStore, prefix: str, inter: int, hidden: int, opts: LayerOptions
) -> GatedMLP:
    return GatedMLP(
        weights.get(prefix + "gate_proj.weight", (inter, hidden)),
        weights.get(prefix + "up_proj.weight", (inter, hidden)),
        weights.get(prefix + "down_proj.weight", (hidden, inter)),
        device=opts.device,
        dtype=opts.dtype,
        cpu_format=opts.cpu_format,
    )


def build_qwen2_moe_mlp(
    config: ModelConfig, index: int, weights: WeightStore, opts: LayerOptions, *, expert_format: str | None
) -> torch.nn.Module:
    """Layer `index`'s MLP: a SharedExpertMoE where the config makes the layer sparse, else the dense
    gated MLP of `intermediate_size`."""
    extra, hidden = config.extra, config.hidden_size
    prefix = f"model.layers.{index}.mlp."
    num_experts = int(extra.get("num_experts", 0))
    sparse = (
        index not in (extra.get("mlp_only_layers") or [])
        and num_experts > 0
        and (index + 1) % int(extra.get("decoder_sparse_step", 1)) == 0
    )
    if not sparse:
        return build_gated_mlp(config, index, weights, opts)
    shard = rank_expert_shard(config, weights, opts)
    w_gate_up, w_down = load_experts(
        weights, prefix, ("gate_proj", "up_proj", "down_proj"), num_experts, hidden, shard.full_intermediate,
        opts.dtype, shard,
    )  # fmt: skip
    shared_inter = int(extra["shared_expert_intermediate_size"])
    if opts.tp_group is not None:  # this rank's slice (kiln.models.sharding.RankShard.shared_intermediate)
        a, b = weights.plan.shards[opts.tp_group.rank].shared_intermediate
        shared_inter = b - a
    return SharedExpertMoE(
        weights.get(prefix + "gate.weight", (num_experts, hidden)),
        w_gate_up,
        w_down,
        top_k=int(extra["num_experts_per_tok"]),
        renormalize=bool(extra.get("norm_topk_prob", False)),
        device=opts.device,
        dtype=opts.dtype,
        expert_format=expert_format,
        tp_group=opts.tp_group,
        shared=_shared_expert(weights, prefix + "shared_expert.", shared_inter, hidden, opts),
        shared_gate=Linear(
            weights.get(prefix + "shared_expert_gate.weight", (1, hidden)),
            None,
            device=opts.device,
            dtype=opts.dtype,
        ),
    )


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE: a Llama-family model with q/k/v biases (`qkv_bias`, default true) whose MLPs come from
    build_qwen2_moe_mlp. Same arguments as LlamaForCausalLM, plus expert_format (see SparseMoE)."""

    def __init__(
        self, config: ModelConfig, weights: WeightStore, *, expert_format: str | None = None, **kwargs
    ):
        config = dataclasses.replace(config, attention_bias=bool(config.extra.get("qkv_bias", True)))
        build_mlp = functools.partial(build_qwen2_moe_mlp, expert_format=check_expert_format(expert_format))
        super().__init__(config, weights, build_mlp=build_mlp, **kwargs)
