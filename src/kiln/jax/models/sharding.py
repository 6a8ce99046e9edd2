"""Tensor parallelism for the JAX Llama: Megatron-style, with jax.sharding and shard_map.

On a Mesh with one axis "tp" of n devices:
  - qkv and gate_up are column parallel: each device holds 1/n of their rows (its heads' q/k/v rows,
    its gate/up columns of the MLP, laid out shard by shard, kiln.jax.models.weights);
  - o and down are row parallel: 1/n of their columns; the partial products are added with
    `lax.psum` over "tp" (two all-reduces per layer);
  - the embedding and the LM head are vocabulary parallel: each device holds 1/n of the (padded)
    vocabulary's rows; a token's embedding comes from the device holding its row (zeros elsewhere,
    then a psum), and each device computes its slice of the logits, which an all-gather joins so that
    every device samples the same token from the full row;
  - the KV cache is split by KV head; norms and the RoPE table are replicated.
The step functions run under `jax.shard_map`, so every kernel (Pallas ones included) sees its
device's local shapes: a pallas_call is not partitioned by the compiler, shard_map hands it its shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.jax.models.forward import TP_AXIS

LAYER_SPECS = {
    "attn_norm": P(),
    "ffn_norm": P(),
    "qkv": P(TP_AXIS, None),
    "qkv_bias": P(TP_AXIS),
    "gate_up": P(TP_AXIS, None),
    "o": P(None, TP_AXIS),
    "down": P(None, TP_AXIS),
}
CACHE_SPEC = P(None, None, TP_AXIS, None)  # [num_blocks, block_size, Hkv, D]: by KV head


def tp_mesh(num_devices: int | None = None, devices: list | None = None) -> Mesh:
    """A one-axis ("tp") mesh over the first `num_devices` of `devices` (default jax.devices(), all
    of them). ValueError when fewer devices exist."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if num_devices is None else num_devices
    if n < 1 or n > len(devices):
        raise ValueError(f"tp_mesh: {n} devices asked for, {len(devices)} available")
    return Mesh(np.array(devices[:n]), (TP_AXIS,))


def param_specs(params: dict[str, Any]) -> dict[str, Any]:
    """The PartitionSpec pytree matching the model's params."""
    return {
        "embed": P(TP_AXIS, None),
        "lm_head": P(TP_AXIS, None),
        "norm": P(),
        "layers": [{key: LAYER_SPECS[key] for key in layer} for layer in params["layers"]],
    }


def place(tree: Any, specs: Any, mesh: Mesh | None) -> Any:
    """device_put every leaf with NamedSharding(mesh, its spec); plain jnp arrays without a mesh."""
    if mesh is None:
        return jax.tree.map(jax.numpy.asarray, tree)
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), tree, specs)


def shard_step(step: Callable, params: dict[str, Any], mesh: Mesh, num_batch_args: int) -> Callable:
    """`step(params, rope, caches, *batch_args)` -> (tokens, caches), per shard, as a function over
    the whole mesh: params and caches split as above, the other arguments replicated."""
    caches = [(CACHE_SPEC, CACHE_SPEC)] * len(params["layers"])
    in_specs = (param_specs(params), P(), caches, *([P()] * num_batch_args))
    return jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=(P(), caches), check_vma=False)
