"""HF architecture name -> model class. New families add a line here (e.g. a MoE model reusing
kiln.models.layers: `MODEL_REGISTRY["MixtralForCausalLM"] = MixtralForCausalLM`)."""

from __future__ import annotations

from kiln.models.config import ModelLoadError
from kiln.models.llama import LlamaForCausalLM
from kiln.models.mixtral import MixtralForCausalLM
from kiln.models.qwen2_moe import Qwen2MoeForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}


def get_model_class(architecture: str, source: str = "") -> type:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(
            f"{source + ': ' if source else ''}unknown architecture {architecture!r} (supported: {known})"
        ) from None
