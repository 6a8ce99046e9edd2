"""How a Llama-family checkpoint is split over `tp` ranks: the plan (which heads, MLP columns and
vocabulary rows each rank owns), the slicing of one tensor (GGUF blocks with their scales included),
and the WeightStore view that hands a rank only its slices. `LlamaForCausalLM(..., tp_group=g)` builds
its layers over that view with the rank's sizes (kiln.models.layers.tp, parallel_linear, embedding).

Attention is split by whole GQA groups (a kv head and the q heads that read it), so every rank's
attention is a smaller GQA attention of the same kind:
  - num_kv_heads >= tp: kv heads split as evenly as possible, uneven when tp does not divide them
    (SmolLM2-135M, 9 q / 3 kv heads, tp 2: rank 0 gets 2 groups = 6 q + 2 kv heads, rank 1 gets 3 + 1);
  - num_kv_heads < tp:  each kv head is replicated on tp / num_kv_heads ranks, which split its q heads
    (tp must be a multiple of num_kv_heads, and a group must have at least that many q heads).
The MLP is split along the intermediate size in units of down_proj's inputs that keep its GGUF blocks
whole: 32 columns, or 256 when a down_proj is a K-quant (Q4_K / Q5_K / Q6_K super-blocks: intermediate
1280 over tp 2 splits 768 + 512; `intermediate_unit` reads the checkpoint, rank 0 decides it once and
every rank's config carries it, `with_intermediate_unit`). The vocabulary (embedding and LM head rows)
is split in 16-row units (int4 packing wants N % 16 == 0), where the sizes allow.

Per rank: q/k/v rows (and biases) of its heads; o_proj columns of its q heads; gate/up rows and
down_proj columns of its intermediate slice; embedding / LM-head rows of its vocabulary slice.
Norms are replicated.

Quantized weights shard together with their scales: GGUF blocks cover 32 consecutive inputs of one
output row (256 for the K-quants), so a row slice is free and a column slice that starts and ends on
block boundaries stays blocks (one that cuts a block, e.g. a K-quant o_proj over 7 heads of 128 a
rank, is dequantized at load and logged);
quantized checkpoint weights (kiln.quant.linear_weights: W8A8, W4A16, block FP8, 2:4) slice through
their own `rows` / `cols`: int4 on group boundaries (act-order weights not along their inputs), block
FP8 on block boundaries, 2:4 on 8-input boundaries, per-channel W8A8 scales follow their rows.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from dataclasses import dataclass

import torch

from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.weights import GGUF_BLOCK_BYTES, GGUFWeight, Weight, WeightStore
from kiln.quant.linear_weights import QUANTIZED_WEIGHT_TYPES

logger = logging.getLogger(__name__)

TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Phi-3 is split like Llama: kiln.models.phi3 names the row blocks of its fused qkv / gate_up tensors
# as q/k/v and gate/up, which the rules below slice.
TP_ARCHITECTURES += ("Phi3ForCausalLM",)
# Qwen3 is split like Llama; its q/k norm weights ([head_dim], shared by every head) are replicated.
TP_ARCHITECTURES += ("Qwen3ForCausalLM",)
# Gemma 3 is split like Llama (kiln.models.gemma3 builds over the same ShardedWeightStore); its four
# norms per layer and q/k norms are replicated.
TP_ARCHITECTURES += ("Gemma3ForCausalLM",)
# Mixture-of-experts models: attention and dense layers as Llama's; routed experts split along their
# intermediate size (tensor parallel) or held whole, num_experts / ep per rank (expert parallel), see
# ExpertShard; routers replicated; Qwen2-MoE's shared expert split like a dense MLP.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
TP_ARCHITECTURES += MOE_ARCHITECTURES


def shard_rows(weight: Weight, start: int, end: int) -> Weight:
    """Rows [start, end) of a matrix [out, in] (GGUF blocks and quantized checkpoint weights included,
    with their scales) or elements of a vector [out]."""
    if isinstance(weight, QUANTIZED_WEIGHT_TYPES):
        return weight.rows(slice(start, end))
    if isinstance(weight, GGUFWeight):
        data = weight.data[start:end].contiguous()
        return GGUFWeight(weight.qtype, data, (end - start, weight.shape[1]))
    return weight[start:end].contiguous()


def shard_cols(weight: Weight, start: int, end: int, what: str = "weight") -> Weight:
    """Columns [start, end) of a matrix [out, in]. GGUF blocks: kept as blocks when start and end are
    multiples of the block (32 inputs; 256 for the K-quants' super-blocks), else the blocks covering
    the slice are decoded and the slice returned as a float32 matrix (logged once per split; e.g. a
    K-quant o_proj over ranks of 7 heads of 128); quantized checkpoint weights slice on their group /
    block boundaries (their `cols`), else ValueError."""
    if isinstance(weight, QUANTIZED_WEIGHT_TYPES):
        try:
            return weight.cols(start, end)
        except ValueError as exc:
            raise ValueError(f"tensor parallel: cannot shard {what}: {exc}; try another tp size") from None
    if not isinstance(weight, GGUFWeight):
        return weight[:, start:end].contiguous()
    qk = weight.block_weights
    n, k = weight.shape
    first, last = start // qk, -(-end // qk)  # the blocks the slice touches
    blocks = weight.data.view(n, k // qk, GGUF_BLOCK_BYTES[weight.qtype])[:, first:last]
    covered = GGUFWeight(weight.qtype, blocks.reshape(n, -1).contiguous(), (n, (last - first) * qk))
    if start % qk == 0 and end % qk == 0:
        return covered
    _log_decoded_slice(re.sub(r"\d+", "N", what), weight.qtype, start, end, qk)
    return covered.dequantize(torch.float32)[:, start - first * qk : end - first * qk].contiguous()


@functools.cache
def _log_decoded_slice(kind: str, qtype: str, start: int, end: int, qk: int) -> None:
    """Once per tensor kind (its name with the layer numbers as N: every layer's o_proj logs once) and
    split."""
    logger.warning(
        "tensor parallel: inputs [%d, %d) of %s (%s) cut its %d-input GGUF blocks: this rank's slice "
        "is dequantized at load and runs dense (a tp size giving every rank a multiple of %d of "
        "these inputs keeps it quantized)", start, end, kind, qtype, qk, qk,
    )  # fmt: skip


def split_evenly(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, end) ranges covering 0..total in `parts` pieces of whole `unit`s, sizes differing by at
    most one unit, larger pieces first (total must be a multiple of unit)."""
    units = total // unit
    base, extra = divmod(units, parts)
    ranges, start = [], 0
    for p in range(parts):
        size = (base + (1 if p < extra else 0)) * unit
        ranges.append((start, start + size))
        start += size
    return ranges


@dataclass(frozen=True)
class RankShard:
    """One rank's slices: q heads [q0, q1), kv heads [kv0, kv1), intermediate [i0, i1), vocab [v0, v1);
    shared_intermediate: its slice of Qwen2-MoE's shared expert (None for other models)."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    shared_intermediate: tuple[int, int] | None = None


def _head_ranges(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    if num_heads % num_kv_heads:
        raise ValueError(
            f"tensor parallel: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp:
        return [((g0 * group, g1 * group), (g0, g1)) for g0, g1 in split_evenly(num_kv_heads, tp)]
    if tp % num_kv_heads:
        raise ValueError(
            f"tensor parallel: tp={tp} ranks cannot share {num_kv_heads} kv heads evenly; use a tp size "
            f"that is at most {num_kv_heads} or a multiple of it"
        )
    replicas = tp // num_kv_heads
    if group < replicas:
        raise ValueError(
            f"tensor parallel: tp={tp} gives each kv head {replicas} ranks but it has only {group} q heads; "
            f"use tp <= {num_heads}"
        )
    out = []
    for rank in range(tp):
        kv, part = divmod(rank, replicas)
        a, b = split_evenly(group, replicas)[part]
        out.append(((kv * group + a, kv * group + b), (kv, kv + 1)))
    return out


def _unit(total: int, tp: int, preferred: int) -> int:
    # whole GGUF blocks / int4-packable row counts when the size allows, else any split (dense weights;
    # a GGUF down_proj's slices that cut its blocks are then dequantized in shard_cols, logged)
    return preferred if total % preferred == 0 and total // preferred >= tp else 1


# ModelConfig.extra key: the unit the MLP intermediate size is split in (with_intermediate_unit)
INTERMEDIATE_UNIT_KEY = "kiln_tp_intermediate_unit"
DEFAULT_INTERMEDIATE_UNIT = 32
_DOWN_PROJ = re.compile(r"model\.layers\.\d+\.mlp\.(shared_expert\.)?down_proj\.weight$")


def intermediate_unit(config: ModelConfig, weights: WeightStore) -> int:
    """The unit of down_proj's inputs the MLP (and Qwen2-MoE's shared expert) is split in under tensor
    parallelism: the largest GGUF block along any layer's down_proj inputs, 256 when one is a K-quant
    (Q4_K / Q5_K / Q6_K), else 32. Only GGUF files are read (their blocks are memory-mapped views)."""
    if "gguf_architecture" not in config.extra:
        return DEFAULT_INTERMEDIATE_UNIT
    shared = int(config.extra.get("shared_expert_intermediate_size") or 0)
    unit = DEFAULT_INTERMEDIATE_UNIT
    for name in weights.names():
        match = _DOWN_PROJ.match(name)
        if match is not None:
            inputs = shared if match.group(1) else config.intermediate_size
            weight = weights.get(name, (config.hidden_size, inputs))
            if isinstance(weight, GGUFWeight):
                unit = max(unit, weight.block_weights)
    return unit


def with_intermediate_unit(config: ModelConfig, unit: int) -> ModelConfig:
    """`config` whose ShardPlan splits the MLP in `unit`s of down_proj's inputs (intermediate_unit's
    answer: the model classes build their ShardPlan from the config alone)."""
    return dataclasses.replace(config, extra={**config.extra, INTERMEDIATE_UNIT_KEY: unit})


def _intermediate_ranges(size: int, tp: int, unit: int, what: str) -> list[tuple[int, int]]:
    """split_evenly of an MLP intermediate size in `unit`s; ValueError when GGUF super-blocks (a unit
    above 32) cannot give every rank one."""
    if unit <= DEFAULT_INTERMEDIATE_UNIT:
        return split_evenly(size, tp, _unit(size, tp, unit))
    blocks = size // unit
    if size % unit or blocks < tp:
        raise ValueError(
            f"tensor parallel: tp={tp} cannot split {what}={size} into whole {unit}-input GGUF "
            f"super-blocks of down_proj (K-quants Q4_K / Q5_K / Q6_K; it holds {blocks}); use tp <= "
            f"{blocks}, or a GGUF whose down_proj has 32-input blocks (Q8_0, Q4_0, Q4_1, Q5_0)"
        )
    return split_evenly(size, tp, unit)


class ShardPlan:
    """The split of `config` over `tp` ranks (ValueError for what cannot be split; see module doc).
    The MLP's unit: `config.extra[INTERMEDIATE_UNIT_KEY]` (with_intermediate_unit), else 32."""

    def __init__(self, config: ModelConfig, tp: int):
        if tp < 1:
            raise ValueError(f"tensor parallel: tp={tp}, expected >= 1")
        if config.architecture not in TP_ARCHITECTURES:
            raise ValueError(
                f"tensor parallel: architecture {config.architecture!r} is not supported (supported: "
                f"{', '.join(TP_ARCHITECTURES)}); run it with tp 1"
            )
        self.config, self.tp = config, tp
        heads = _head_ranges(config.num_heads, config.num_kv_heads, tp)
        unit = int(config.extra.get(INTERMEDIATE_UNIT_KEY, DEFAULT_INTERMEDIATE_UNIT))
        inter = _intermediate_ranges(config.intermediate_size, tp, unit, "intermediate_size")
        vocab = split_evenly(config.vocab_size, tp, _unit(config.vocab_size, tp, 16))
        if any(b == a for a, b in inter) or any(b == a for a, b in vocab):
            raise ValueError(
                f"tensor parallel: tp={tp} leaves a rank with no MLP columns or vocabulary rows "
                f"(intermediate_size={config.intermediate_size}, vocab_size={config.vocab_size})"
            )
        shared = [None] * tp
        shared_size = int(config.extra.get("shared_expert_intermediate_size") or 0)
        if config.architecture in MOE_ARCHITECTURES:
            moe_size = moe_intermediate_size(config)
            if moe_size < tp:
                raise ValueError(
                    f"tensor parallel: tp={tp} leaves a rank with no expert columns (expert intermediate "
                    f"size {moe_size}); use tp <= {moe_size}, or expert parallelism (--ep)"
                )
            if shared_size:
                if shared_size < tp:
                    raise ValueError(
                        f"tensor parallel: tp={tp} leaves a rank with no shared-expert columns "
                        f"(shared_expert_intermediate_size={shared_size})"
                    )
                shared = _intermediate_ranges(shared_size, tp, unit, "shared_expert_intermediate_size")
        self.shards = [
            RankShard(q, kv, i, v, sh) for (q, kv), i, v, sh in zip(heads, inter, vocab, shared, strict=True)
        ]

    @property
    def vocab_sizes(self) -> list[int]:
        return [s.vocab[1] - s.vocab[0] for s in self.shards]

    @property
    def max_kv_heads(self) -> int:
        return max(s.kv_heads[1] - s.kv_heads[0] for s in self.shards)

    def rank_config(self, rank: int) -> ModelConfig:
        """The config rank `rank`'s model is built with: its head counts, intermediate and vocab slices."""
        s = self.shards[rank]
        return dataclasses.replace(
            self.config,
            num_heads=s.q_heads[1] - s.q_heads[0],
            num_kv_heads=s.kv_heads[1] - s.kv_heads[0],
            intermediate_size=s.intermediate[1] - s.intermediate[0],
            vocab_size=s.vocab[1] - s.vocab[0],
            eos_token_ids=list(self.config.eos_token_ids),
        )


_LAYER_TENSOR = re.compile(
    r"model\.layers\.\d+\.(self_attn|mlp|mlp\.shared_expert)\.(\w+)_proj\.(weight|bias)$"
)
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


class ShardedWeightStore:
    """A WeightStore view that returns rank `rank`'s slice of every tensor (the full tensor is read,
    sliced, and dropped, one tensor at a time). Shapes asked for are the rank's shapes."""

    def __init__(self, inner: WeightStore, plan: ShardPlan, rank: int):
        self.inner, self.plan, self.rank = inner, plan, rank
        self.source = inner.source

    def __contains__(self, name: str) -> bool:
        return name in self.inner

    def names(self) -> list[str]:
        return self.inner.names()

    def get_optional(self, name: str, shape: tuple[int, ...]) -> Weight | None:
        return self.get(name, shape) if name in self.inner else None

    def _rule(self, name: str) -> tuple[int, int, int, int] | None:
        """(axis, full size along it, start, end) of the slice of `name`, None when replicated."""
        c, s = self.plan.config, self.plan.shards[self.rank]
        d = c.head_dim
        if name in _VOCAB_TENSORS:
            return (0, c.vocab_size, *s.vocab)
        match = _LAYER_TENSOR.match(name)
        if match is None:
            return None
        proj = match.group(2)
        if match.group(3) == "bias" and proj in ("o", "down"):
            return None  # a row-parallel layer's bias is whole on every rank (added on rank 0)
        if match.group(1) == "mlp.shared_expert":
            shared = (int(c.extra["shared_expert_intermediate_size"]), *s.shared_intermediate)
            return {"gate": (0, *shared), "up": (0, *shared), "down": (1, *shared)}.get(proj)
        q0, q1 = s.q_heads[0] * d, s.q_heads[1] * d
        kv0, kv1 = s.kv_heads[0] * d, s.kv_heads[1] * d
        rules = {
            "q": (0, c.num_heads * d, q0, q1),
            "k": (0, c.num_kv_heads * d, kv0, kv1),
            "v": (0, c.num_kv_heads * d, kv0, kv1),
            "o": (1, c.num_heads * d, q0, q1),
            "gate": (0, c.intermediate_size, *s.intermediate),
            "up": (0, c.intermediate_size, *s.intermediate),
            "down": (1, c.intermediate_size, *s.intermediate),
        }
        return rules.get(proj)

    def get(self, name: str, shape: tuple[int, ...]) -> Weight:
        rule = self._rule(name)
        if rule is None:
            return self.inner.get(name, shape)
        axis, full, start, end = rule
        if len(shape) <= axis or shape[axis] != end - start:
            raise ModelLoadError(
                f"{self.source}: rank {self.rank} asked for {name!r} with shape {tuple(shape)}, but its "
                f"shard along dim {axis} is [{start}, {end})"
            )
        full_shape = tuple(full if i == axis else n for i, n in enumerate(shape))
        weight = self.inner.get(name, full_shape)
        return shard_rows(weight, start, end) if axis == 0 else shard_cols(weight, start, end, name)


# ---- mixture-of-experts layers ----


def routed_experts(config: ModelConfig) -> int:
    """The routed expert count: `num_local_experts` (Mixtral) or `num_experts` (Qwen-MoE); 0 = dense."""
    extra = config.extra
    return int(extra.get("num_experts") or extra.get("num_local_experts") or 0)


def moe_intermediate_size(config: ModelConfig) -> int:
    """Each routed expert's intermediate size: `moe_intermediate_size` (Qwen-MoE), else Mixtral's
    `intermediate_size`."""
    return int(config.extra.get("moe_intermediate_size") or config.intermediate_size)


def check_expert_parallel(config: ModelConfig, ep: int) -> None:
    """ValueError unless `config` can be split over `ep` expert-parallel ranks (whole experts each)."""
    if ep < 1:
        raise ValueError(f"expert parallel: ep={ep}, expected >= 1")
    if ep == 1:
        return
    experts = routed_experts(config)
    if config.architecture not in MOE_ARCHITECTURES or experts == 0:
        raise ValueError(
            f"expert parallel: --ep {ep} needs a mixture-of-experts model ({', '.join(MOE_ARCHITECTURES)}); "
            f"{config.architecture!r} has no routed experts (use --tp)"
        )
    if experts % ep:
        raise ValueError(
            f"expert parallel: --ep {ep} must divide the number of routed experts ({experts}) so every rank "
            f"holds as many whole experts; use an ep that divides {experts}"
        )


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts one rank holds: experts [e0, e1) of `num_experts`, each with intermediate rows
    [i0, i1) of `intermediate` (tensor parallel: every expert, a slice of each; expert parallel: whole
    experts, num_experts / ranks of them)."""

    experts: tuple[int, int]
    intermediate: tuple[int, int]
    num_experts: int
    full_intermediate: int


def expert_shard(config: ModelConfig, ranks: int, rank: int, expert_parallel: bool) -> ExpertShard:
    """Rank `rank`'s ExpertShard of `config` (the unsplit config) over `ranks` ranks."""
    experts, inter = routed_experts(config), moe_intermediate_size(config)
    if ranks == 1:
        return ExpertShard((0, experts), (0, inter), experts, inter)
    if expert_parallel:
        check_expert_parallel(config, ranks)
        per_rank = experts // ranks
        return ExpertShard((rank * per_rank, (rank + 1) * per_rank), (0, inter), experts, inter)
    # the routed experts are read whole and dequantized (kiln.models.mixtral.load_experts) before
    # they are sliced, so no GGUF block constrains this split
    rows = split_evenly(inter, ranks, _unit(inter, ranks, 32))[rank]
    return ExpertShard((0, experts), rows, experts, inter)


def unsharded_config(config: ModelConfig, weights: WeightStore | ShardedWeightStore) -> ModelConfig:
    """The whole checkpoint's config (a model built over a ShardedWeightStore sees its rank's sizes)."""
    return weights.plan.config if isinstance(weights, ShardedWeightStore) else config


# Pipeline parallelism builds a stage from LlamaForCausalLM's `pipeline_layers` hook, which the MoE
# models, Qwen3 and Phi-3 inherit (tests/distributed/test_pipeline_parallel.py runs each). Gemma 3 has its own
# decoder (sliding/global layers, scaled embedding) without the hook.
PP_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


def pipeline_stages(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """The decoder layers [start, end) of each of `pp` contiguous pipeline stages, as even as possible
    (earlier stages take the extra layer: 30 layers over 4 stages -> 8, 8, 7, 7)."""
    if pp < 1 or pp > num_layers:
        raise ValueError(
            f"pipeline parallel: --pp {pp} over {num_layers} decoder layers; every stage needs at least "
            f"one layer, so use 1 <= pp <= {num_layers}"
        )
    return split_evenly(num_layers, pp)


def check_pipeline_parallel(config: ModelConfig, pp: int) -> list[tuple[int, int]]:
    """pipeline_stages(config.num_layers, pp), or ValueError for a model pipeline parallelism cannot
    split (an architecture outside PP_ARCHITECTURES)."""
    if pp > 1 and config.architecture not in PP_ARCHITECTURES:
        raise ValueError(
            f"pipeline parallel: {config.architecture!r} cannot be split into stages yet (supported: "
            f"{', '.join(PP_ARCHITECTURES)}); use --tp"
        )
    return pipeline_stages(config.num_layers, pp)
