"""The mixture-of-experts keys of a config (Mixtral, Qwen2-MoE, Qwen3-MoE), checked once before the
model is built: a missing or out-of-range key is a ModelLoadError naming it, not a KeyError, a
ZeroDivisionError or a top-k past the expert count deep in the first forward."""

from __future__ import annotations

from kiln.models.config import ModelConfig, ModelLoadError


def _int(extra: dict, key: str, source: str, low: int, high: int | None = None) -> int:
    value = extra.get(key)
    if value is None:
        raise ModelLoadError(f"{source}: required mixture-of-experts key {key!r} is missing")
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ModelLoadError(f"{source}: {key} = {value!r}, expected an integer {bound}")
    return value


def check_moe_config(
    config: ModelConfig, source: str, experts_key: str, *, required: tuple[str, ...] = ()
) -> None:
    """experts_key: the routed expert count's key ("num_local_experts" for Mixtral, "num_experts" for
    Qwen, where 0 makes every layer dense); num_experts_per_tok must lie in 1..that count;
    decoder_sparse_step, when present, >= 1; mlp_only_layers a list of layer indices; `required`:
    further positive integer keys (Qwen2-MoE's shared_expert_intermediate_size)."""
    extra = config.extra
    if experts_key not in extra and experts_key == "num_experts" and "num_local_experts" in extra:
        experts_key = "num_local_experts"  # transformers 5 writes Qwen's count under Mixtral's name
    experts = _int(extra, experts_key, source, 0 if experts_key == "num_experts" else 1)
    if experts:
        _int(extra, "num_experts_per_tok", source, 1, experts)
    if extra.get("decoder_sparse_step") is not None:
        _int(extra, "decoder_sparse_step", source, 1)
    only = extra.get("mlp_only_layers")
    if only is not None and (
        not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < config.num_layers for i in only)
    ):
        raise ModelLoadError(
            f"{source}: mlp_only_layers = {only!r}, expected a list of layer indices below "
            f"{config.num_layers}"
        )
    for key in required:
        _int(extra, key, source, 1)
