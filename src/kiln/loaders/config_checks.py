"""Checks on a checkpoint's hyper-parameters before a model is built from them.

A config.json or GGUF metadata with a zero, negative, non-integer or absurd size would otherwise fail
deep inside the model code (a division by zero, a shape error) or allocate without bound (the rope
table is [max_position_embeddings, head_dim]). Each check raises a ModelLoadError that names the file
and the key as that file spells it ("num_attention_heads" in config.json, "llama.attention.head_count"
in a GGUF).
"""

from __future__ import annotations

from typing import Any

from kiln.models.config import ModelConfig, ModelLoadError

# Upper bounds far past any released model, low enough that a corrupt value cannot make the loader
# allocate terabytes: the largest vocabularies are ~256k, hidden sizes ~25k, head dims <= 256.
LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_layers": 1024,
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 24,
}

# ModelConfig field -> its key in an HF config.json
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "max_position_embeddings": "max_position_embeddings",
}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_hf_config(hf: Any, source: str) -> dict[str, Any]:
    """The types of an HF config.json's entries that ModelConfig.from_hf reads; returns it."""
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{source}: expected a JSON object, got a {json_type(hf)}")
    architectures = hf.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise ModelLoadError(f"{source}: 'architectures' is {architectures!r}, expected a list of names")
    optional = {"num_key_value_heads", "head_dim", "max_position_embeddings"}
    for key in HF_KEYS.values():
        value = hf.get(key)
        if value is None and key in optional:
            continue
        if value is not None and (not is_int(value) or value < 1):
            raise ModelLoadError(f"{source}: {key!r} is {value!r}, expected an integer >= 1")
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ModelLoadError(f"{source}: {key!r} is {hf[key]!r}, expected an object or null")
    for key in ("rms_norm_eps", "rope_theta"):
        if hf.get(key) is not None and not _is_number(hf[key]):
            raise ModelLoadError(f"{source}: {key!r} is {hf[key]!r}, expected a number")
    eos = hf.get("eos_token_id")
    if eos is not None and not (is_int(eos) or (isinstance(eos, list) and all(map(is_int, eos)))):
        raise ModelLoadError(f"{source}: 'eos_token_id' is {eos!r}, expected an integer or a list of them")
    if hf.get("bos_token_id") is not None and not is_int(hf["bos_token_id"]):
        raise ModelLoadError(f"{source}: 'bos_token_id' is {hf['bos_token_id']!r}, expected an integer")
    window = hf.get("sliding_window")
    if window not in (None, False) and (not is_int(window) or window < 0):
        raise ModelLoadError(f"{source}: 'sliding_window' is {window!r}, expected an integer or null")
    return hf


def check_model_config(config: ModelConfig, source: str, keys: dict[str, str]) -> ModelConfig:
    """Sizes in range and consistent with each other; `keys` maps a field to the key the file uses."""
    for field, limit in LIMITS.items():
        value = getattr(config, field)
        if not is_int(value) or not 1 <= value <= limit:
            raise ModelLoadError(
                f"{source}: {keys.get(field, field)!r} is {value!r}, expected an integer in [1, {limit}]"
            )
    if config.num_heads % config.num_kv_heads:
        raise ModelLoadError(
            f"{source}: {config.num_heads} attention heads ({keys['num_heads']!r}) are not a multiple of "
            f"{config.num_kv_heads} key/value heads ({keys['num_kv_heads']!r})"
        )
    if config.head_dim % 2:
        raise ModelLoadError(
            f"{source}: head dimension {config.head_dim} is odd; rotary embeddings need it even"
        )
    if not (_is_number(config.rope_theta) and config.rope_theta > 0):
        raise ModelLoadError(f"{source}: rope theta {config.rope_theta!r}, expected a number > 0")
    if config.sliding_window is not None and (not is_int(config.sliding_window) or config.sliding_window < 1):
        raise ModelLoadError(f"{source}: sliding window {config.sliding_window!r}, expected an integer >= 1")
    if config.architecture in MOE_KEYS:
        check_moe_config(config, source)
    return config


# mixture-of-experts architecture -> (its routed-expert count's key, further positive integer keys)
MOE_KEYS = {
    "MixtralForCausalLM": ("num_local_experts", ()),
    "Qwen2MoeForCausalLM": ("num_experts", ("shared_expert_intermediate_size",)),
    "Qwen3MoeForCausalLM": ("num_experts", ()),
}


def check_moe_config(config: ModelConfig, source: str) -> None:
    """The routing keys of a MOE_KEYS architecture: its expert count (Qwen's may be 0: every layer
    dense; transformers 5 writes it under Mixtral's name), num_experts_per_tok in 1..that count,
    decoder_sparse_step >= 1 when present, mlp_only_layers a list of layer indices, and the further
    keys. A ModelLoadError naming the key, not a KeyError, a ZeroDivisionError or a top-k past the
    expert count deep in the first forward."""
    extra = config.extra
    experts_key, required = MOE_KEYS[config.architecture]
    if experts_key not in extra and experts_key == "num_experts" and "num_local_experts" in extra:
        experts_key = "num_local_experts"
    experts = _moe_int(extra, experts_key, source, 0 if experts_key == "num_experts" else 1)
    if experts:
        _moe_int(extra, "num_experts_per_tok", source, 1, experts)
    if extra.get("decoder_sparse_step") is not None:
        _moe_int(extra, "decoder_sparse_step", source, 1)
    only = extra.get("mlp_only_layers")
    if only is not None and (
        not isinstance(only, list) or not all(is_int(i) and 0 <= i < config.num_layers for i in only)
    ):
        raise ModelLoadError(
            f"{source}: mlp_only_layers = {only!r}, expected a list of layer indices below "
            f"{config.num_layers}"
        )
    for key in required:
        _moe_int(extra, key, source, 1)


def _moe_int(extra: dict, key: str, source: str, low: int, high: int | None = None) -> int:
    value = extra.get(key)
    if value is None:
        raise ModelLoadError(f"{source}: required mixture-of-experts key {key!r} is missing")
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ModelLoadError(f"{source}: {key} = {value!r}, expected an integer {bound}")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (for error messages)."""
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )
