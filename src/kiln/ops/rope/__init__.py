"""Rotary position embedding: the cos/sin cache (cache.py), the in-place rotation (spec.py),
its backends beside them."""

from kiln.ops.rope import cpu, triton  # noqa: F401  (registers the implementations)
from kiln.ops.rope.cache import rope_cos_sin_cache
from kiln.ops.rope.spec import rotary_embedding

__all__ = ["rope_cos_sin_cache", "rotary_embedding"]
