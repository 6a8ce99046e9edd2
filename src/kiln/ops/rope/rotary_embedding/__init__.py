"""rotary_embedding: spec (signature, reference, shapes) in spec.py, one file per backend beside it
(no Pallas GPU kernel: on a GPU, `kiln.jax.rotary_embedding` runs xla.py)."""

from kiln.ops.rope.rotary_embedding import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING, rotary_embedding

__all__ = ["ROTARY_EMBEDDING", "rotary_embedding"]
