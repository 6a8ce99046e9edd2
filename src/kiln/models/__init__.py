"""Kiln's models: the Llama family (llama.py) and the architectures built from its parts (qwen3.py,
gemma3.py, phi3.py) or adding experts (mixtral.py, qwen2_moe.py, qwen3_moe.py), their layers
(layers/), how a checkpoint is split over tensor-parallel ranks (sharding.py), config and registry."""

from kiln.models.attention_metadata import AttentionMetadata
from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.llama import LlamaForCausalLM
from kiln.models.registry import MODEL_REGISTRY, get_model_class

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "MODEL_REGISTRY",
    "ModelConfig",
    "ModelLoadError",
    "get_model_class",
]
