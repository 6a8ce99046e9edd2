"""ModelConfig: the architecture hyper-parameters Kiln's models need, read from an HF config.json or
from GGUF metadata (kiln.loaders.gguf builds one from `<arch>.*` keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.ops.rope.cache import LONGROPE_ALIASES, SCALING_TYPES, rope_inv_freq
from kiln.ops.rope.longrope import longrope_attention_factor, longrope_inv_freqs


class ModelLoadError(ValueError):
    """A checkpoint that Kiln cannot load: malformed or truncated file, unknown architecture, missing
    tensor, mismatched shape. The message names the file (and the tensor when there is one)."""


# What a config.json that leaves a key out means: the default of the transformers config class of each
# architecture (as of transformers 5.x), for every key Kiln reads that changes the model.
# from_hf fills these in for absent keys only (a key present, null included, is read as it stands), so
# config.extra holds them too (the MoE routing, Gemma 3's attention scale, read from there).
_HF_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
}  # fmt: skip
_QWEN_WINDOW = {"max_position_embeddings": 32768, "sliding_window": 4096, "max_window_layers": 28}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},  # LlamaConfig: num_key_value_heads, head_dim from the head count
    "MistralForCausalLM": {
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096,
    },
    "MixtralForCausalLM": {
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "Phi3ForCausalLM": {
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
    },
    "Qwen2ForCausalLM": {**_QWEN_WINDOW, "num_key_value_heads": 32, "attention_bias": True},
    "Qwen2MoeForCausalLM": {
        **_QWEN_WINDOW, "num_key_value_heads": 16, "qkv_bias": True, "num_experts": 60,
        "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    },
    "Qwen3ForCausalLM": {**_QWEN_WINDOW, "num_key_value_heads": 32, "head_dim": 128},
    "Qwen3MoeForCausalLM": {
        **_QWEN_WINDOW, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
    },
    "Gemma3ForCausalLM": {
        "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072, "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    },
}  # fmt: skip
# the other name transformers takes for a key (its config class's attribute_map): key -> alias
HF_ALIASES: dict[str, dict[str, str]] = {
    "MixtralForCausalLM": {"num_local_experts": "num_experts"},
    "Qwen3MoeForCausalLM": {"num_experts": "num_local_experts"},
}
# architectures whose transformers MLP reads `hidden_activation` (and ignores `hidden_act`)
HIDDEN_ACTIVATION_ARCHITECTURES = frozenset({"Gemma3ForCausalLM"})
# architectures whose transformers attention reads `sliding_window` (Llama's ignores the key)
SLIDING_WINDOW_ARCHITECTURES = frozenset({
    "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM",
    "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
})  # fmt: skip
# the Qwen family: a window only with use_sliding_window (default false), in the layers transformers
# gives it when config.json has no layer_types (its config classes' own rule; see _qwen_layer_types)
QWEN_WINDOWED = frozenset(
    {"Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
)
# architectures whose transformers rope reads partial_rotary_factor (the others rotate whole heads)
PARTIAL_ROTARY_ARCHITECTURES = frozenset({"Phi3ForCausalLM"})


@dataclass
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2).

    rope_scaling: None or the HF dict ({"rope_type": "linear"|"llama3", "factor", ...}).
    sliding_window: window W of the attention layers that slide (None = full attention everywhere);
    layer_types: per-layer "full_attention" | "sliding_attention" when the checkpoint mixes them.
    extra: the raw config with the absent HF_DEFAULTS keys filled in (for architectures that need more
    keys, e.g. MoE routing).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    layer_types: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    rotary_dim: int | None = None  # dims of each head that RoPE rotates (None: all, head_dim)

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None = full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from an HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` keys or 5.x
        `rope_parameters`). A key left out means what it means to transformers' config class for the
        architecture (HF_DEFAULTS). Raises ModelLoadError naming `source` when a required key is missing."""
        architectures = hf.get("architectures") or []
        if not architectures:
            raise ModelLoadError(
                f"{source}: no 'architectures' entry, cannot tell which model class to build"
            )
        architecture = architectures[0]
        hf = _with_hf_defaults(hf, architecture)

        def need(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ModelLoadError(f"{source}: required key {key!r} is missing")
            return hf[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        hf = _split_layer_type_keys(hf, architecture, source)
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", hf["rope_theta"]))
        scaling = hf.get("rope_scaling") or rope or None
        if scaling is not None:
            scaling = dict(scaling)
            if "type" in scaling and "rope_type" not in scaling:
                scaling["rope_type"] = scaling.pop("type")
            scaling.pop("rope_theta", None)
            if scaling.get("rope_type", "default") == "default":
                scaling = None
        rope_type = None if scaling is None else scaling.get("rope_type")
        phi3_yarn = architecture == "Phi3ForCausalLM" and rope_type == "yarn"  # Phi-3's name for longrope
        if scaling is not None and rope_type not in (*SCALING_TYPES, *LONGROPE_ALIASES) and not phi3_yarn:
            raise ModelLoadError(
                f"{source}: rope scaling type {rope_type!r} is not supported (supported: "
                f"{', '.join(SCALING_TYPES[1:])}; Phi-3's su / yarn as longrope)"
            )
        if scaling is not None and (rope_type in LONGROPE_ALIASES or phi3_yarn):
            scaling = _longrope_scaling(scaling, hf)
        elif scaling is not None and rope_type == "llama3":
            scaling["original_max_position_embeddings"] = _original_max_positions(scaling, hf)
        num_layers = int(need("num_hidden_layers"))
        sliding_window, layer_types = _sliding_window(hf, architecture, num_layers)
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        if layer_types and len(layer_types) != num_layers:
            raise ModelLoadError(
                f"{source}: layer_types must hold one entry per layer ({num_layers}), got {len(layer_types)}"
            )
        # Qwen2-MoE's q/k/v biases are qkv_bias (Qwen2MoeForCausalLM reads it), the others' attention_bias
        bias_key = "qkv_bias" if architecture == "Qwen2MoeForCausalLM" else "attention_bias"
        act_key = "hidden_activation" if architecture in HIDDEN_ACTIVATION_ARCHITECTURES else "hidden_act"
        config = cls(
            architecture=architecture,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf["max_position_embeddings"]),
            tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            attention_bias=bool(hf[bias_key]),
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=hf.get(act_key),
            layer_types=list(layer_types) if layer_types else None,
            extra=dict(hf),
            rotary_dim=_rotary_dim(hf, rope, num_heads, hidden, source)
            if architecture in PARTIAL_ROTARY_ARCHITECTURES
            else None,
        )
        _check_rope(config, source)
        return config


def _check_rope(config: ModelConfig, source: str) -> None:
    """The rope settings as the model will build its cos/sin cache from them: a malformed one (a
    llama3 dict without low_freq_factor, a linear factor of 0, longrope factor lists of the wrong
    length) fails at load naming the file, not later inside the model's construction."""
    dim, scaling = config.rotary_dim or config.head_dim, config.rope_scaling
    try:
        if scaling is not None and scaling.get("rope_type") == "longrope":
            longrope_inv_freqs(dim, config.rope_theta, scaling)
            longrope_attention_factor(scaling, config.max_position_embeddings)
        else:
            rope_inv_freq(dim, config.rope_theta, scaling)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{source}: {exc}") from None


def _sliding_window(hf: dict[str, Any], architecture: str, num_layers: int) -> tuple[Any, Any]:
    """(window, layer_types) as transformers reads them for `architecture`: no window where its
    attention ignores the key (Llama); the class's default window when the key is absent (HF_DEFAULTS,
    filled in); the Qwen family's only with use_sliding_window, in the layers its config class picks
    when there are no layer_types."""
    layer_types = hf.get("layer_types")
    if architecture not in SLIDING_WINDOW_ARCHITECTURES:
        return None, layer_types
    window = hf.get("sliding_window")
    if architecture in QWEN_WINDOWED:
        if not hf.get("use_sliding_window", False) or not window:
            return None, layer_types
        if not layer_types:
            layer_types = _qwen_layer_types(hf, architecture, num_layers)
    return window, layer_types


def _qwen_layer_types(hf: dict[str, Any], architecture: str, num_layers: int) -> list[str] | None:
    """transformers' default layer_types of a windowed Qwen config: Qwen2 / Qwen3 slide from layer
    max_window_layers on, Qwen2-MoE in the even-indexed layers below it, Qwen3-MoE everywhere (None)."""
    if architecture == "Qwen3MoeForCausalLM":
        return None
    max_window_layers = int(hf.get("max_window_layers", 28))
    if architecture == "Qwen2MoeForCausalLM":
        slides = [(i + 1) % 2 == 1 and i < max_window_layers for i in range(num_layers)]
    else:
        slides = [i >= max_window_layers for i in range(num_layers)]
    return ["sliding_attention" if slide else "full_attention" for slide in slides]


def _with_hf_defaults(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    """A copy of `hf` with the keys it leaves out set to the transformers config class's defaults for
    `architecture` (HF_DEFAULTS; a key under its other name, HF_ALIASES, counts as present)."""
    hf = dict(hf)
    for key, alias in HF_ALIASES.get(architecture, {}).items():
        if key not in hf and alias in hf:
            hf[key] = hf[alias]
    for key, value in {**_HF_COMMON_DEFAULTS, **HF_DEFAULTS.get(architecture, {})}.items():
        hf.setdefault(key, value)
    return hf


def _original_max_positions(scaling: dict[str, Any], hf: dict[str, Any]) -> int:
    """The pre-training context length of a llama3 / longrope dict, as transformers' rope
    standardization sets it: the config's top-level original_max_position_embeddings first (Phi-3's, its
    config class's 4096 when absent, filled in), else the dict's, else max_position_embeddings."""
    original = hf.get("original_max_position_embeddings")
    if original is None:
        original = scaling.get("original_max_position_embeddings")
    return int(hf["max_position_embeddings"] if original is None else original)


def _longrope_scaling(scaling: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE dict as kiln.ops.rope.longrope takes it, completed the way transformers does:
    "su" (and Phi-3's "yarn") mean longrope; original_max_position_embeddings as
    _original_max_positions reads it; factor, when absent, max_position_embeddings /
    original_max_position_embeddings."""
    scaling = dict(scaling, rope_type="longrope")
    scaling["original_max_position_embeddings"] = _original_max_positions(scaling, hf)
    if scaling.get("factor") is None:
        max_positions = int(hf["max_position_embeddings"])
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return scaling


def _rotary_dim(
    hf: dict[str, Any], rope: dict[str, Any], num_heads: int, hidden: int, source: str
) -> int | None:
    """head_dim * partial_rotary_factor (Phi-4-mini rotates 3/4 of each head); None when it is 1.
    Read for PARTIAL_ROTARY_ARCHITECTURES only, as transformers does."""
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor is None or float(factor) == 1.0:
        return None
    head_dim = int(hf.get("head_dim") or hidden // num_heads)
    rotary_dim = int(head_dim * float(factor))
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(
            f"{source}: partial_rotary_factor {factor!r} gives {rotary_dim} rotary dims of head_dim "
            f"{head_dim}, expected an even number in [2, head_dim]"
        )
    return rotary_dim


def _split_layer_type_keys(hf: dict[str, Any], architecture: str, source: str) -> dict[str, Any]:
    """A copy of `hf` in the flat form from_hf reads, for configs with two kinds of layers (Gemma 3):
    transformers 5.x `rope_parameters` {"full_attention": {...}, "sliding_attention": {...}} become
    the full-attention layers' rope_parameters plus `rope_local_base_freq` (the sliding layers' theta,
    as Gemma 3's 4.x configs name it; their rope must be unscaled); a Gemma 3 config without
    `layer_types` gets them from `sliding_window_pattern` (every pattern-th layer global, default 6, as
    transformers does)."""
    hf = dict(hf)
    rope = hf.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(
                f"{source}: rope_parameters.sliding_attention has rope_type {local['rope_type']!r}; only "
                "unscaled rope is supported for sliding-window layers"
            )
        if "rope_theta" in local:
            hf["rope_local_base_freq"] = float(local["rope_theta"])
        hf["rope_parameters"] = dict(rope["full_attention"])
    if architecture == "Gemma3ForCausalLM" and not hf.get("layer_types"):
        pattern = int(hf.get("sliding_window_pattern") or 6)
        layers = int(hf.get("num_hidden_layers") or 0)
        hf["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
    return hf
