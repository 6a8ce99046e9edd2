"""moe_route in jax.numpy (XLA): top-k of the logits (jax.lax.top_k: highest first, ties to the lower
index), their softmax / sigmoid scores gathered, renormalized when asked; float32 math."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.ops.moe.moe_route.spec import MOE_ROUTE


def moe_route_xla(router_logits, top_k, renormalize=True, scoring="softmax"):
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(logits, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


MOE_ROUTE.register_jax("xla", moe_route_xla)
