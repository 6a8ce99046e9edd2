"""Mixtral (sparse mixture-of-experts Llama) and the pieces the other MoE models share.

    per layer:  h, r = rms_norm(h, r);  h = attn(h);  h, r = rms_norm(h, r);  h = moe(h)
    moe(x) = sum_{j < top_k} w_j(x) * expert_{e_j(x)}(x)   with (w, e) = moe_route(x @ W_router^T)
Attention, norms, rotary, embedding and LM head are the Llama family's (kiln.models.llama / layers);
only the MLP differs: the model passes `build_mixtral_moe` as its `build_mlp`, and each
`DecoderLayer(attn, mlp)` gets a SparseMoE. Experts are kept stacked, `w_gate_up [E, 2I, hidden]`
(gate rows then up rows) and `w_down [E, hidden, I]`, the layout `kiln.ops.fused_moe` takes.

Tensor parallelism (`opts.tp_group`): every rank holds every expert's rows [i0, i1) of w_gate_up's
gate and up halves and the matching columns of w_down, and all-reduces the layer's output, like the
dense MLP; the router is replicated. Expert parallelism (a kiln.models.layers.expert_parallel
ExpertParallelGroup): every rank holds num_experts / N whole experts, and the tokens go to them
(dispatch_combine); kiln.models.sharding.ExpertShard says which.

Checkpoint names (HF): `model.layers.{i}.block_sparse_moe.gate.weight` [E, hidden] (the router) and
`...block_sparse_moe.experts.{e}.w1|w3|w2.weight` (gate, up, down); or transformers-5's
`model.layers.{i}.mlp.gate.weight` with stacked `...mlp.experts.gate_up_proj` / `...mlp.experts.down_proj`.
"""

from __future__ import annotations

import functools

import torch

import kiln.ops
from kiln.models.config import ModelConfig
from kiln.models.layers import Linear, TPGroup
from kiln.models.layers.expert_parallel import (
    dispatch_combine,
    expert_parallel_size,
    gather_token_slices,
    token_slice,
)
from kiln.models.layers.tp import all_reduce
from kiln.models.llama import LayerOptions, LlamaForCausalLM
from kiln.models.sharding import ExpertShard, expert_shard, unsharded_config
from kiln.models.weights import Weight, WeightStore

EXPERT_FORMATS = (None, "fp8")


def check_expert_format(expert_format: str | None) -> str | None:
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
    return expert_format


def _dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """An expert matrix as a dense tensor: quantized checkpoints' experts (GGUF blocks, FP8, int4) are
    dequantized, as the fused MoE kernels take dense expert weights."""
    return weight.to(dtype) if isinstance(weight, torch.Tensor) else weight.dequantize(dtype)


def load_experts(
    weights: WeightStore,
    prefix: str,
    names: tuple[str, str, str],
    num_experts: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    shard: ExpertShard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate_up [E_r, 2 I_r, hidden], w_down [E_r, hidden, I_r]) in `dtype`, from per-expert matrices
    `{prefix}experts.{e}.{gate|up|down}.weight`, or stacked `{prefix}experts.gate_up_proj` / `down_proj`.
    shard: the experts [e0, e1) and intermediate rows [i0, i1) of each to keep (E_r = e1 - e0,
    I_r = i1 - i0; tensor / expert parallelism); None keeps everything."""
    shard = shard or ExpertShard((0, num_experts), (0, inter), num_experts, inter)
    (e0, e1), (i0, i1) = shard.experts, shard.intermediate
    if prefix + "experts.gate_up_proj" in weights:
        gate_up = _dense(
            weights.get(prefix + "experts.gate_up_proj", (num_experts, 2 * inter, hidden)), dtype
        )
        down = _dense(weights.get(prefix + "experts.down_proj", (num_experts, hidden, inter)), dtype)
        gate_up = torch.cat([gate_up[e0:e1, i0:i1], gate_up[e0:e1, inter + i0 : inter + i1]], dim=1)
        return gate_up.contiguous(), down[e0:e1, :, i0:i1].contiguous()
    gate, up, down = names
    rows = i1 - i0
    gate_up = torch.empty((e1 - e0, 2 * rows, hidden), dtype=dtype)
    w_down = torch.empty((e1 - e0, hidden, rows), dtype=dtype)
    for local, e in enumerate(range(e0, e1)):
        p = f"{prefix}experts.{e}."
        gate_up[local, :rows] = _dense(weights.get(p + f"{gate}.weight", (inter, hidden)), dtype)[i0:i1]
        gate_up[local, rows:] = _dense(weights.get(p + f"{up}.weight", (inter, hidden)), dtype)[i0:i1]
        w_down[local] = _dense(weights.get(p + f"{down}.weight", (hidden, inter)), dtype)[:, i0:i1]
    return gate_up, w_down


def rank_expert_shard(config: ModelConfig, weights: WeightStore, opts: LayerOptions) -> ExpertShard:
    """The routed experts this rank's MoE layers hold (all of them in one process)."""
    group = opts.tp_group
    if group is None:
        return expert_shard(config, 1, 0, False)
    full = unsharded_config(config, weights)
    return expert_shard(full, group.world_size, group.rank, expert_parallel_size(group) > 1)


class SparseMoE(torch.nn.Module):
    """x [T, hidden] -> [T, hidden]: route each token to its top-k experts and mix their SwiGLU outputs.

    router: [E, hidden]; w_gate_up: [E_r, 2I_r, hidden]; w_down: [E_r, hidden, I_r], this rank's experts
    (E_r = E and I_r = I in one process). Router logits are computed in the model dtype, scores in
    float32 (`kiln.ops.moe_route`), the experts by `kiln.ops.fused_moe`.
    expert_format: None keeps the experts in the model dtype; "fp8" stores them as per-expert-scaled
    float8_e4m3fn (half the memory and weight traffic of bf16: Mixtral-8x7B's experts fit one 80 GB GPU).
    tp_group: a TPGroup (every expert's I_r-row slice; the output is all-reduced) or an
    ExpertParallelGroup (E_r = E / N whole experts, tokens dispatched to them; see the module doc).
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
        tp_group: TPGroup | None = None,
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
        self.tp_group = tp_group
        self.ep = expert_parallel_size(tp_group)

    def local_experts(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts on x [n, hidden] with local ids / weights [n, k]: fused_moe."""
        return kiln.ops.fused_moe(
            x, self.w_gate_up, self.w_down, topk_weights, topk_ids, self.w_gate_up_scale, self.w_down_scale
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (topk_weights float32 [n, k], topk_ids int32 [n, k]); n may be 0."""
        if x.shape[0] == 0:
            return x.new_empty((0, self.top_k), dtype=torch.float32), x.new_empty(
                (0, self.top_k), dtype=torch.int32
            )
        return kiln.ops.moe_route(self.router(x), self.top_k, self.renormalize)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for x [T, hidden]: complete in one process and under expert
        parallelism; under tensor parallelism this rank's partial sum (forward all-reduces it)."""
        if self.ep == 1:
            topk_weights, topk_ids = self.route(x)
            return self.local_experts(x, topk_ids, topk_weights)
        t0, t1 = token_slice(x.shape[0], self.ep, self.tp_group.rank)
        mine = x[t0:t1]
        topk_weights, topk_ids = self.route(mine)
        experts_per_rank = self.w_gate_up.shape[0]
        part = dispatch_combine(
            mine, topk_weights, topk_ids, experts_per_rank, self.local_experts, self.tp_group
        )
        return gather_token_slices(part, x.shape[0], self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return out if self.ep > 1 else all_reduce(out, self.tp_group)


def build_mixtral_moe(
    config: ModelConfig, index: int, weights: WeightStore, opts: LayerOptions, *, expert_format: str | None
) -> SparseMoE:
    """Layer `index`'s sparse MLP: softmax routing over `num_local_experts`, top `num_experts_per_tok`,
    weights renormalized over the chosen experts."""
    extra, hidden = config.extra, config.hidden_size
    shard = rank_expert_shard(config, weights, opts)
    num_experts, inter = shard.num_experts, shard.full_intermediate
    prefix = f"model.layers.{index}.block_sparse_moe."
    if prefix + "gate.weight" not in weights:  # transformers-5 names
        prefix = f"model.layers.{index}.mlp."
    w_gate_up, w_down = load_experts(
        weights, prefix, ("w1", "w3", "w2"), num_experts, hidden, inter, opts.dtype, shard
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
        tp_group=opts.tp_group,
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
