"""kiln.jax.models.Llama: a Llama-family decoder in JAX over a paged KV cache, from a Kiln checkpoint.

    from kiln.loaders import open_checkpoint
    model = Llama.from_checkpoint(open_checkpoint(path))       # path None: the embedded SmolLM2
    kiln.jax.generate(model, [[1, 2, 3], [4, 5]], max_tokens=16)

The weights come through Kiln's loaders (kiln.jax.models.weights), the math is kiln.jax's ops
(kiln.jax.models.forward), and `prefill` / `decode` are jitted once per input shape: callers pad the
batch and the prompt length to buckets (kiln.jax.models.generate does) so that a new length does not
recompile. With `mesh` (kiln.jax.models.sharding.tp_mesh), the model is tensor parallel over the
mesh's devices.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kiln.jax.models import sharding
from kiln.jax.models.config import JaxLlamaConfig, config_from_checkpoint
from kiln.jax.models.forward import decode_step, prefill_step
from kiln.jax.models.weights import load_params, rope_table


class Llama:
    """A Llama/Mistral/Qwen2-style model (kiln.jax.models.config.LLAMA_ARCHITECTURES) in JAX.

    config: the JaxLlamaConfig the steps are specialized on; params: the weight pytree (jax arrays,
    sharded over `mesh` when given); rope: float32 [max_position, rotary_dim]; dtype: activation and
    weight dtype; eos_token_ids: the checkpoint's end-of-sequence ids.
    """

    def __init__(
        self,
        config: JaxLlamaConfig,
        params: dict[str, Any],
        rope: np.ndarray,
        *,
        dtype: Any = jnp.float32,
        mesh: Mesh | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        if mesh is not None and mesh.shape.get(sharding.TP_AXIS) != config.tp:
            raise ValueError(f"Llama: mesh {dict(mesh.shape)} does not match the config's tp={config.tp}")
        if mesh is None and config.tp != 1:
            raise ValueError(f"Llama: tp={config.tp} weights need a mesh")
        self.config, self.dtype, self.mesh = config, dtype, mesh
        self.eos_token_ids = tuple(eos_token_ids)
        self.params = sharding.place(params, sharding.param_specs(params), mesh)
        self.rope = sharding.place(jnp.asarray(rope, jnp.float32), jax.sharding.PartitionSpec(), mesh)
        prefill = functools.partial(prefill_step, config=config)
        decode = functools.partial(decode_step, config=config)
        if mesh is not None:
            prefill = sharding.shard_step(prefill, params, mesh, num_batch_args=5)
            decode = sharding.shard_step(decode, params, mesh, num_batch_args=5)
        self._prefill = jax.jit(prefill, donate_argnums=(2,))
        self._decode = jax.jit(decode, donate_argnums=(2,))

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Any,
        *,
        dtype: Any = jnp.float32,
        implementation: str | None = None,
        mesh: Mesh | None = None,
        block_size: int = 16,
    ) -> Llama:
        """Build from an opened checkpoint (`kiln.loaders.open_checkpoint(path)`: GGUF, HF safetensors
        or random:<preset>). implementation: kiln.jax backend for every op (None: this device's
        default, xla on the CPU; "pallas_tpu" / "pallas_gpu" run interpreted off their accelerator,
        slowly). mesh: tensor parallel over its "tp" axis. ValueError for an unsupported model."""
        if implementation not in (None, "xla", "pallas_tpu", "pallas_gpu"):
            raise ValueError(
                f"Llama: unknown implementation {implementation!r}; "
                "expected None, xla, pallas_tpu or pallas_gpu"
            )
        tp = 1 if mesh is None else int(mesh.shape[sharding.TP_AXIS])
        config = config_from_checkpoint(
            checkpoint.config, tp=tp, block_size=block_size, implementation=implementation
        )
        params = load_params(checkpoint, config, np.dtype(jnp.dtype(dtype)))
        eos = tuple(checkpoint.config.eos_token_ids or ())
        return cls(config, params, rope_table(checkpoint, config), dtype=dtype, mesh=mesh, eos_token_ids=eos)

    def new_cache(self, num_blocks: int) -> list[tuple[jax.Array, jax.Array]]:
        """Zeroed paged KV cache: one (key_cache, value_cache) per layer, each [num_blocks,
        block_size, num_kv_heads, D] in the model dtype (split by KV head over the mesh). Block 0 is
        the scratch page."""
        c = self.config
        shape = (num_blocks, c.block_size, c.num_kv_heads, c.head_dim)
        placed = None if self.mesh is None else jax.sharding.NamedSharding(self.mesh, sharding.CACHE_SPEC)
        zeros = _zeros_fn(shape, jnp.dtype(self.dtype), placed)
        return [(zeros(), zeros()) for _ in range(c.num_layers)]

    def prefill(self, caches, tokens, lens, block_tables, key, temperature):
        """tokens int32 [B, S] right-padded, lens int32 [B] (>= 1), block_tables int32 [B, max_blocks]
        (page ids > 0), key a jax.random key, temperature float32 scalar (0: greedy) -> (next tokens
        int32 [B], caches). `caches` is donated: use the returned one."""
        return self._prefill(self.params, self.rope, caches, tokens, lens, block_tables, key, temperature)

    def decode(self, caches, tokens, positions, block_tables, key, temperature):
        """tokens int32 [B] at positions int32 [B] -> (next tokens int32 [B], caches); as prefill."""
        return self._decode(self.params, self.rope, caches, tokens, positions, block_tables, key, temperature)


@functools.lru_cache(maxsize=32)
def _zeros_fn(shape: tuple[int, ...], dtype, placed):
    """A jitted zeros of this shape, dtype and placement, compiled once (a fresh lambda each
    new_cache compiled again on every generate: ~38 ms of each TTFT on a 2-core CPU)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=placed)
