"""The moe_route Pallas kernel both Pallas backends run (pallas_tpu.py pads for Mosaic, pallas_gpu.py
for Triton; each picks its block rows and compiler params).

A program owns `block_rows` tokens and holds their whole (padded) logit rows: top-k is k rounds of
(row max, lowest alive column holding it, knock that column out), the winners' scores placed in a
[block_rows, padded_k] tile that the wrapper slices to [num_tokens, k]. The ranking is
jax.lax.top_k's (xla.py), ties included: each logit is mapped to an int32 key in IEEE total order
(+0 above -0, +NaN above +inf, -NaN below -inf), and equal keys go to the lower expert id. Padding
experts are -inf and never alive, so they are never chosen whatever their logit; padding tokens are
0 (finite: their softmax is NaN-free).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import pad_to

_INT32_MIN = -(2**31)
_MAGNITUDE_BITS = 0x7FFFFFFF


def total_order_key(values):
    """float32 -> int32 whose signed order is IEEE total order (negative floats get their magnitude
    bits flipped, so a larger magnitude sorts lower)."""
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    return bits ^ ((bits >> 31) & _MAGNITUDE_BITS)


def from_total_order_key(keys):
    """The inverse of total_order_key (the same flip: it keeps the sign bit)."""
    return jax.lax.bitcast_convert_type(keys ^ ((keys >> 31) & _MAGNITUDE_BITS), jnp.float32)


def route_kernel(logits_ref, weights_ref, ids_ref, *, num_experts, top_k, renormalize, sigmoid, unroll):
    """One program's tokens: their top_k (weight, expert id) pairs, highest first (module doc)."""
    logits = logits_ref[...].astype(jnp.float32)  # [block_rows, padded_experts]
    columns = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    real = columns < num_experts
    if not sigmoid:
        row_max = jnp.max(logits, axis=1, keepdims=True)  # padding is -inf: it changes nothing
        denom = jnp.sum(jnp.exp(logits - row_max), axis=1, keepdims=True)
    keys = total_order_key(logits)
    slots = jax.lax.broadcasted_iota(jnp.int32, weights_ref.shape, 1)
    padded_experts = logits.shape[1]

    def one_round(i, carry):
        alive_flags, top_weights, top_ids = carry
        alive = alive_flags != 0
        best = jnp.max(jnp.where(alive, keys, _INT32_MIN), axis=1, keepdims=True)
        # the lowest alive column holding the best key; one always exists since top_k <= num_experts
        best_id = jnp.min(jnp.where(alive & (keys == best), columns, padded_experts), axis=1, keepdims=True)
        logit = from_total_order_key(best)
        score = 1.0 / (1.0 + jnp.exp(-logit)) if sigmoid else jnp.exp(logit - row_max) / denom
        top_weights = jnp.where(slots == i, score, top_weights)
        top_ids = jnp.where(slots == i, best_id, top_ids)
        return jnp.where(columns == best_id, 0, alive_flags), top_weights, top_ids

    # alive flags as int32, not bool: a plain 32-bit vector is the conservative loop carry for Mosaic
    # (and the Triton lowering takes a fori_loop only when it is not unrolled: unroll=False there)
    carry = (
        real.astype(jnp.int32),
        jnp.zeros(weights_ref.shape, jnp.float32),
        jnp.zeros(ids_ref.shape, jnp.int32),
    )
    _, top_weights, top_ids = jax.lax.fori_loop(0, top_k, one_round, carry, unroll=unroll)
    if renormalize:  # unused slots hold 0
        top_weights = top_weights / jnp.sum(top_weights, axis=1, keepdims=True)
    weights_ref[...] = top_weights
    ids_ref[...] = top_ids


def route_call(router_logits, top_k, renormalize, sigmoid, *, padded_experts, padded_k, block_rows,
               compiler_params, unroll, interpret):  # fmt: skip
    """router_logits [tokens, experts] -> (weights float32, ids int32) [tokens, top_k] through
    route_kernel, experts padded to padded_experts, tokens to a multiple of block_rows."""
    tokens, experts = router_logits.shape
    padded_tokens = -(-tokens // block_rows) * block_rows
    logits = jnp.pad(router_logits, ((0, 0), (0, padded_experts - experts)), constant_values=-jnp.inf)
    logits = pad_to(logits, 0, padded_tokens)
    out_spec = pl.BlockSpec((block_rows, padded_k), lambda i: (i, 0))
    kernel = functools.partial(
        route_kernel, num_experts=experts, top_k=top_k, renormalize=renormalize, sigmoid=sigmoid,
        unroll=unroll,
    )  # fmt: skip
    weights, ids = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.float32),
            jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.int32),
        ),
        grid=(padded_tokens // block_rows,),
        in_specs=[pl.BlockSpec((block_rows, padded_experts), lambda i: (i, 0))],
        out_specs=(out_spec, out_spec),
        compiler_params=compiler_params,
        interpret=interpret,
    )(logits)
    return weights[:tokens, :top_k], ids[:tokens, :top_k]
