"""Kiln's models: the Llama family (llama.py) and its MoE variants (mixtral.py, qwen2_moe.py), their
layers (layers/), how a checkpoint is split over tensor-parallel ranks (sharding.py), config and registry."""

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
