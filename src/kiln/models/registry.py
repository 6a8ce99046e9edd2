"""HF architecture name -> model class. New families add a line here (e.g. a MoE model reusing
kiln.models.layers: `MODEL_REGISTRY["MixtralForCausalLM"] = MixtralForCausalLM`)."""

from __future__ import annotations

from kiln.models.config import ModelLoadError
from kiln.models.gemma3 import Gemma3ForCausalLM
from kiln.models.llama import LlamaForCausalLM
from kiln.models.mixtral import MixtralForCausalLM
from kiln.models.phi3 import Phi3ForCausalLM
from kiln.models.qwen2_moe import Qwen2MoeForCausalLM
from kiln.models.qwen3 import Qwen3ForCausalLM
from kiln.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(architecture: str, source: str = "") -> type:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(
            f"{source + ': ' if source else ''}unknown architecture {architecture!r} (supported: {known})"
        ) from None
