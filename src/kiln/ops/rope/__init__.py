"""Rotary position embedding: the cos/sin cache (cache.py, a plain helper built once per model) and
the in-place rotation op (rotary_embedding/: spec + one file per backend)."""

from kiln.ops.rope.cache import rope_cos_sin_cache
from kiln.ops.rope.rotary_embedding import rotary_embedding

__all__ = ["rope_cos_sin_cache", "rotary_embedding"]
