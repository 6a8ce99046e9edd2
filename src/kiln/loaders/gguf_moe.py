"""Mixture-of-experts GGUF files: the routing hyper-parameters from the metadata and the stacked
expert tensors under the names Kiln's MoE models read (kiln.loaders.gguf calls both).

llama.cpp's converter writes every MoE layer's experts as three stacked tensors, GGUF
`blk.N.ffn_{gate,up,down}_exps.weight` = [E, I, hidden], [E, I, hidden], [E, hidden, I] (outer dim
first), and the router as `blk.N.ffn_gate_inp.weight` [E, hidden]. They become transformers-5's
stacked names, `model.layers.N.mlp.experts.gate_up_proj` [E, 2I, hidden] (gate rows, then up rows:
one concatenation, done when the tensor is read) and `...mlp.experts.down_proj`, and
`model.layers.N.mlp.gate.weight`, which kiln.models.mixtral.load_experts takes for every MoE model.

Metadata (`<arch>.*`) -> config.extra, the keys the MoE model classes read from an HF config:
    expert_count -> num_experts (Qwen) / num_local_experts (Mixtral, GGUF arch "llama"),
    expert_used_count -> num_experts_per_tok, expert_feed_forward_length -> moe_intermediate_size,
    expert_shared_feed_forward_length -> shared_expert_intermediate_size (Qwen2-MoE),
    expert_weights_norm -> norm_topk_prob (default: what llama.cpp does for the arch: Qwen3-MoE and
    Mixtral renormalize the top-k weights, Qwen2-MoE does not).
A layer without `ffn_gate_inp` is dense (in `mlp_only_layers`), so a file with dense layers between
sparse ones loads as written.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch

from kiln.loaders.config_checks import is_int
from kiln.models.config import ModelConfig, ModelLoadError

# GGUF architecture -> (HF architecture with experts, expert-count key in config.extra, default
# norm_topk_prob). A "llama" file with `llama.expert_count` is a Mixtral.
MOE_ARCHITECTURES = {
    "llama": ("MixtralForCausalLM", "num_local_experts", True),
    "qwen2moe": ("Qwen2MoeForCausalLM", "num_experts", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "num_experts", True),
}
MAX_EXPERTS = 1 << 12

# GGUF per-layer name -> HF name (kiln.loaders.gguf adds these to its table); the stacked experts
# get their final names in stack_expert_tensors.
EXPERT_TENSOR_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

Loaders = dict[str, tuple[tuple[int, ...], Callable[[], Any]]]


def _int_key(meta: dict[str, Any], key: str, source: str, low: int, high: int, required: bool) -> int | None:
    if key not in meta:
        if required:
            raise ModelLoadError(f"{source}: metadata key {key!r} is missing")
        return None
    value = meta[key]
    if not is_int(value) or not low <= value <= high:
        raise ModelLoadError(
            f"{source}: metadata key {key!r} is {value!r}, expected an integer in [{low}, {high}]"
        )
    return int(value)


def apply_moe_metadata(
    config: ModelConfig, meta: dict[str, Any], tensor_names: set[str], source: str
) -> ModelConfig:
    """`config` with the MoE architecture and routing keys of a GGUF file's metadata; unchanged for a
    dense file (no `<arch>.expert_count`, or 0). ModelLoadError naming the key for bad values."""
    arch = config.extra["gguf_architecture"]
    count = meta.get(f"{arch}.expert_count")
    if arch not in MOE_ARCHITECTURES or count in (None, 0):
        return config
    architecture, count_key, default_norm = MOE_ARCHITECTURES[arch]
    experts = _int_key(meta, f"{arch}.expert_count", source, 1, MAX_EXPERTS, True)
    used = _int_key(meta, f"{arch}.expert_used_count", source, 1, experts, True)
    norm = meta.get(f"{arch}.expert_weights_norm", default_norm)
    if not isinstance(norm, bool):
        raise ModelLoadError(
            f"{source}: metadata key '{arch}.expert_weights_norm' is {norm!r}, expected a bool"
        )
    extra = {
        **config.extra,
        count_key: experts,
        "num_experts_per_tok": used,
        "norm_topk_prob": norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(config.num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
        ],
    }
    if arch != "llama":  # Mixtral's experts are feed_forward_length wide; Qwen's have their own key
        extra["moe_intermediate_size"] = _int_key(
            meta, f"{arch}.expert_feed_forward_length", source, 1, 1 << 20, True
        )
    if arch == "qwen2moe":
        extra["shared_expert_intermediate_size"] = _int_key(
            meta, f"{arch}.expert_shared_feed_forward_length", source, 1, 1 << 20, True
        )
        extra["qkv_bias"] = config.attention_bias
    return dataclasses.replace(config, architecture=architecture, extra=extra)


_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate|up|down)_proj\.weight$")


def stack_expert_tensors(loaders: Loaders, source: str) -> Loaders:
    """Rename the stacked expert tensors (see the module docstring): per layer, `experts.gate_proj` and
    `experts.up_proj` become one `experts.gate_up_proj` [E, 2I, hidden] concatenated when read,
    `experts.down_proj.weight` becomes `experts.down_proj`; the Qwen2-MoE shared-expert gate, a GGUF
    vector [hidden], becomes HF's [1, hidden]. Other entries are kept."""
    out: Loaders = {}
    for name, (shape, load) in loaders.items():
        match = _STACKED.match(name)
        if name.endswith(".mlp.shared_expert_gate.weight") and len(shape) == 1:
            out[name] = ((1, shape[0]), lambda load=load: load().reshape(1, -1))
        elif match is None:
            out[name] = (shape, load)
        elif match.group(2) == "down":
            out[match.group(1) + "down_proj"] = (shape, load)
        elif match.group(2) == "gate":
            up_name = match.group(1) + "up_proj.weight"
            if up_name not in loaders:
                raise ModelLoadError(
                    f"{source}: {name!r} has no matching {up_name!r} (stacked expert up rows)"
                )
            up_shape, load_up = loaders[up_name]
            if up_shape != shape or len(shape) != 3:
                raise ModelLoadError(
                    f"{source}: stacked expert tensors {name!r} {shape} and {up_name!r} {up_shape} must be "
                    "[experts, intermediate, hidden] of one shape"
                )
            gate_up_shape = (shape[0], 2 * shape[1], shape[2])
            out[match.group(1) + "gate_up_proj"] = (
                gate_up_shape,
                lambda load=load, load_up=load_up: torch.cat([load(), load_up()], dim=1),
            )
        elif match.group(1) + "gate_proj.weight" not in loaders:
            raise ModelLoadError(f"{source}: {name!r} has no matching stacked expert gate tensor")
    return out
