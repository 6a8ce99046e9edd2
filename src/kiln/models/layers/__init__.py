"""Reusable building blocks of the models: linear (dense / GGUF / int4-packed), embedding, rotary,
paged attention, gated MLP."""

from kiln.models.layers.attention import PagedAttention
from kiln.models.layers.embedding import VocabEmbedding
from kiln.models.layers.linear import Linear
from kiln.models.layers.mlp import GatedMLP
from kiln.models.layers.rotary import RotaryEmbedding

__all__ = ["GatedMLP", "Linear", "PagedAttention", "RotaryEmbedding", "VocabEmbedding"]
