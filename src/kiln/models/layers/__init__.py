"""Reusable building blocks of the models: linear (dense / GGUF / int4-packed; row-parallel), embedding
and LM head (vocab-parallel), rotary, paged attention, gated MLP. Each takes the tensor-parallel group
it belongs to when built (`tp_group`, kiln.models.layers.tp; None = one process)."""

from kiln.models.layers.attention import PagedAttention
from kiln.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.models.layers.linear import Linear
from kiln.models.layers.mlp import GatedMLP
from kiln.models.layers.parallel_linear import RowParallelLinear
from kiln.models.layers.rotary import RotaryEmbedding
from kiln.models.layers.tp import TPGroup

__all__ = [
    "GatedMLP",
    "Linear",
    "PagedAttention",
    "ParallelLMHead",
    "RotaryEmbedding",
    "RowParallelLinear",
    "TPGroup",
    "VocabParallelEmbedding",
]
