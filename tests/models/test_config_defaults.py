"""A config.json that leaves a key out means what transformers' config class for the architecture means:
for every architecture in the registry, the settings that change the computation (norm epsilon, rope
base and scaling, sliding windows, head sizes, biases, tying, activation, Gemma 3's attention scale and
local rope base, MoE routing) as ModelConfig.from_hf reads a config of only the required keys, equal
to what transformers reads from the same dict. A wrong default would run another model with no error."""

from __future__ import annotations

import pytest

from kiln.loaders.config_checks import HF_KEYS, check_hf_config, check_model_config
from kiln.models.config import ModelConfig
from kiln.models.gemma3 import Gemma3Options
from kiln.models.registry import MODEL_REGISTRY
from kiln.models.sharding import moe_intermediate_size, routed_experts

transformers = pytest.importorskip("transformers")

# architecture -> (model_type, transformers config class name)
HF_CLASSES = {
    "LlamaForCausalLM": ("llama", "LlamaConfig"),
    "MistralForCausalLM": ("mistral", "MistralConfig"),
    "MixtralForCausalLM": ("mixtral", "MixtralConfig"),
    "Phi3ForCausalLM": ("phi3", "Phi3Config"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2Config"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeConfig"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3Config"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeConfig"),
    "Gemma3ForCausalLM": ("gemma3_text", "Gemma3TextConfig"),
}
MOE = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}
# transformers' attention reads no bias key for these: q/k/v biases always (Qwen2) or never
FIXED_BIAS = {"MistralForCausalLM": False, "MixtralForCausalLM": False, "Phi3ForCausalLM": False,
              "Qwen2ForCausalLM": True}  # fmt: skip
# one window for every layer (the others: in the layers layer_types says slide; Llama: none)
ALL_LAYERS_WINDOW = {"MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM"}
LAYERS = 30  # past Qwen's max_window_layers default (28)


def _required(architecture: str, **more) -> dict:
    """A config.json of only the keys Kiln requires (32 heads: every class's default kv-head count
    divides it)."""
    return {
        "architectures": [architecture], "model_type": HF_CLASSES[architecture][0], "vocab_size": 256,
        "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": LAYERS,
        "num_attention_heads": 32, **more,
    }  # fmt: skip


def _theirs(architecture: str, hf: dict):
    return getattr(transformers, HF_CLASSES[architecture][1]).from_dict(dict(hf))


def _hf_values(architecture: str, c) -> dict:
    """The computation-relevant settings as transformers' modeling code reads them from config `c`."""
    gemma = architecture == "Gemma3ForCausalLM"
    rope = dict(c.rope_parameters["full_attention"] if gemma else c.rope_parameters)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    partial = rope.pop("partial_rotary_factor", 1.0) if architecture == "Phi3ForCausalLM" else 1.0
    rope.pop("partial_rotary_factor", None)
    theta = rope.pop("rope_theta")
    scaling = None if rope.get("rope_type", "default") == "default" else rope
    if scaling is not None and scaling["rope_type"] == "longrope" and scaling.get("factor") is None:
        # transformers' _compute_longrope_parameters takes it as this ratio (Kiln stores the ratio)
        scaling["factor"] = c.max_position_embeddings / scaling["original_max_position_embeddings"]
    if architecture == "LlamaForCausalLM":
        windows = [None] * c.num_hidden_layers
    elif architecture in ALL_LAYERS_WINDOW:
        windows = [c.sliding_window] * c.num_hidden_layers
    else:
        windows = [c.sliding_window if t == "sliding_attention" else None for t in c.layer_types]
    if architecture == "Qwen2MoeForCausalLM":
        bias = c.qkv_bias
    else:
        bias = FIXED_BIAS.get(architecture, getattr(c, "attention_bias", False))
    values = {
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": theta, "rope_scaling": scaling,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": bias, "sliding_windows": windows, "head_dim": head_dim,
        "num_kv_heads": c.num_key_value_heads, "rotary_dim": int(head_dim * partial),
        "hidden_act": c.hidden_activation if gemma else c.hidden_act,
        "mlp_bias": bool(getattr(c, "mlp_bias", False)),
    }  # fmt: skip
    if gemma:
        values.update(
            query_pre_attn_scalar=c.query_pre_attn_scalar,
            sliding_rope_theta=c.rope_parameters["sliding_attention"]["rope_theta"],
            final_softcap=c.final_logit_softcapping,
        )
    if architecture in MOE:
        mixtral = architecture == "MixtralForCausalLM"
        values.update(
            num_experts=c.num_local_experts if mixtral else c.num_experts,
            top_k=c.num_experts_per_tok,
            renormalize=True if mixtral else c.norm_topk_prob,
            decoder_sparse_step=1 if mixtral else c.decoder_sparse_step,
            mlp_only_layers=[] if mixtral else list(c.mlp_only_layers),
            expert_intermediate_size=c.intermediate_size if mixtral else c.moe_intermediate_size,
            shared_expert_intermediate_size=getattr(c, "shared_expert_intermediate_size", None),
        )
    return values


def _kiln_values(config: ModelConfig) -> dict:
    """The same settings as Kiln's model classes read them from `config`."""
    extra, architecture = config.extra, config.architecture
    values = {
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "sliding_windows": [config.layer_sliding_window(i) for i in range(config.num_layers)],
        "head_dim": config.head_dim, "num_kv_heads": config.num_kv_heads,
        "rotary_dim": config.rotary_dim or config.head_dim, "hidden_act": config.hidden_act,
        "mlp_bias": bool(extra.get("mlp_bias")),
    }  # fmt: skip
    if architecture == "Gemma3ForCausalLM":
        options = Gemma3Options.from_config(config)
        values.update(
            query_pre_attn_scalar=options.query_pre_attn_scalar,
            sliding_rope_theta=options.sliding_rope_theta,
            final_softcap=options.final_softcap,
        )
    if architecture == "Qwen2MoeForCausalLM":  # what Qwen2MoeForCausalLM builds its attention with
        values["attention_bias"] = bool(extra.get("qkv_bias", True))
    if architecture in MOE:
        mixtral = architecture == "MixtralForCausalLM"
        values.update(
            num_experts=routed_experts(config),
            top_k=extra.get("num_experts_per_tok"),
            renormalize=True if mixtral else bool(extra.get("norm_topk_prob", False)),
            decoder_sparse_step=int(extra.get("decoder_sparse_step", 1)),
            mlp_only_layers=list(extra.get("mlp_only_layers") or []),
            expert_intermediate_size=moe_intermediate_size(config),
            shared_expert_intermediate_size=extra.get("shared_expert_intermediate_size"),
        )
    return values


def _ours(hf: dict) -> ModelConfig:
    """ModelConfig as the safetensors loader builds it, with its checks (a refusal fails the test)."""
    config = ModelConfig.from_hf(check_hf_config(dict(hf), "config.json"), "config.json")
    return check_model_config(config, "config.json", HF_KEYS)


def _assert_same(hf: dict) -> None:
    architecture = hf["architectures"][0]
    ours, theirs = _kiln_values(_ours(hf)), _hf_values(architecture, _theirs(architecture, hf))
    differ = {k: (ours[k], theirs[k]) for k in theirs if ours[k] != theirs[k]}
    assert not differ, f"{architecture}: (kiln, transformers) differ: {differ}"


def test_every_registered_architecture_is_covered():
    assert set(MODEL_REGISTRY) == set(HF_CLASSES)


@pytest.mark.parametrize("architecture", sorted(HF_CLASSES))
def test_a_config_of_only_the_required_keys_reads_as_transformers_reads_it(architecture):
    _assert_same(_required(architecture))


# the classes whose num_key_value_heads may be null (the others refuse it)
@pytest.mark.parametrize(
    "architecture", ["LlamaForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_null_kv_heads_mean_one_per_attention_head(architecture):
    hf = _required(architecture, num_key_value_heads=None)
    _assert_same(hf)
    assert _ours(hf).num_kv_heads == 32


@pytest.mark.parametrize(
    "architecture", ["Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
)
def test_qwen_use_sliding_window_without_a_window_size_slides_by_the_class_default(architecture):
    hf = _required(architecture, use_sliding_window=True)
    _assert_same(hf)
    assert any(_ours(hf).layer_sliding_window(i) == 4096 for i in range(LAYERS))


def test_gemma3_with_a_head_dim_but_no_query_pre_attn_scalar_scales_by_256():
    hf = _required("Gemma3ForCausalLM", head_dim=64, num_key_value_heads=8)
    _assert_same(hf)
    assert Gemma3Options.from_config(_ours(hf)).query_pre_attn_scalar == 256


def test_gemma3_reads_hidden_activation_not_hidden_act():
    _assert_same(_required("Gemma3ForCausalLM", hidden_act="silu"))
    _assert_same(_required("Gemma3ForCausalLM", hidden_act="gelu", hidden_activation="gelu_pytorch_tanh"))


def test_gemma3_5x_rope_parameters_without_thetas_take_the_class_defaults():
    rope = {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}
    _assert_same(_required("Gemma3ForCausalLM", rope_parameters=rope))


@pytest.mark.parametrize(
    "architecture, key",
    [("MixtralForCausalLM", "num_experts"), ("Qwen3MoeForCausalLM", "num_local_experts")],
)
def test_moe_expert_count_under_its_other_name(architecture, key):
    _assert_same(_required(architecture, **{key: 4}, num_experts_per_tok=2))


def test_llama3_rope_without_original_max_position_embeddings_takes_max_position_embeddings():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    _assert_same(_required("LlamaForCausalLM", rope_scaling=scaling, max_position_embeddings=8192))
    _assert_same(_required("LlamaForCausalLM", rope_scaling=scaling))


def _longrope(architecture: str, **more) -> dict:
    head_dim = 1024 // 32
    factors = [1.0 + i / 100 for i in range(head_dim // 2)]
    scaling = {"rope_type": "longrope", "short_factor": factors, "long_factor": [2 * f for f in factors]}
    return _required(architecture, rope_scaling={**scaling, **more})


def test_phi3_longrope_without_max_positions_uses_phi3_defaults():
    _assert_same(_longrope("Phi3ForCausalLM"))


def test_phi3_longrope_original_max_position_embeddings_is_the_top_level_key():
    """transformers' Phi3Config puts its top-level original_max_position_embeddings (default 4096) over
    the one in rope_scaling."""
    _assert_same(_longrope("Phi3ForCausalLM", original_max_position_embeddings=2048))
    hf = _longrope("Phi3ForCausalLM", original_max_position_embeddings=2048)
    _assert_same({**hf, "original_max_position_embeddings": 1024, "max_position_embeddings": 8192})


def test_tiny_gemma3_whose_config_json_leaves_the_defaults_out_matches_transformers(tmp_path):
    """End to end: a checkpoint saved by transformers with its config.json stripped of keys equal to
    Gemma3TextConfig's defaults (attention scale 256, not head_dim 24; rope bases 1e6 / 1e4; window;
    tied head; ...) gives transformers' logits (it ran with scale 1/sqrt(24) and base 1e4 before)."""
    import json

    import torch

    from kiln.loaders.safetensors import load_safetensors_dir
    from kiln.models import get_model_class
    from tests.models.helpers import prompt_logits

    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=24, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    hf = transformers.Gemma3ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(0.1 * noise if "norm" in name else 0.3 * noise)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    defaults = (
        "query_pre_attn_scalar", "rope_parameters", "sliding_window", "tie_word_embeddings",
        "max_position_embeddings", "rms_norm_eps", "num_key_value_heads",
    )  # fmt: skip
    path.write_text(json.dumps({k: v for k, v in saved.items() if k not in defaults}))
    ours, weights = load_safetensors_dir(str(tmp_path))
    model = get_model_class(ours.architecture)(ours, weights)
    prompt = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 17, 90]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].double()
    out = prompt_logits(model, prompt).double()
    assert ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item() < 1e-4
