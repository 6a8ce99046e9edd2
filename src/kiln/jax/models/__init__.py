"""JAX models built from kiln.jax ops: `Llama` (kiln.jax.models.llama), `generate`, and tensor
parallelism over a device mesh (`tp_mesh`, kiln.jax.models.sharding)."""

from kiln.jax.models.config import JaxLlamaConfig
from kiln.jax.models.generate import generate
from kiln.jax.models.llama import Llama
from kiln.jax.models.sharding import tp_mesh

__all__ = ["JaxLlamaConfig", "Llama", "generate", "tp_mesh"]
