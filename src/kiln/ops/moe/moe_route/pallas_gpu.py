"""moe_route as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU). See spec.py for the math.

A program owns `block_rows` tokens and holds their whole logit rows in registers: the experts are
padded to a power of two with -inf and the tokens to a multiple of block_rows (Triton's blocks are
powers of two). Top-k is k rounds (a loop, not unrolled) of (row max, lowest column holding it, knock
that column out); the winners' scores go to a [block_rows, next_pow2(k)] tile that the wrapper slices
to [num_tokens, k].

The ranking is jax.lax.top_k's, as in pallas_tpu.py: each logit is mapped to an int32 key in IEEE
total order (+0 above -0, +NaN above +inf, -NaN below -inf) and equal keys go to the lower expert id.
Padding columns are never alive, so they are never chosen whatever their logit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.moe.moe_route.pallas_tpu import from_total_order_key, total_order_key
from kiln.ops.moe.moe_route.spec import MOE_ROUTE
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up

_INT32_MIN = -(2**31)
# elements of one program's [block_rows, padded_experts] tile: a few such float32 / int32 tiles live
# at once (logits, keys, alive flags), which 4 warps hold in registers up to about this size
_TILE_ELEMENTS = 4096


def _route_kernel(logits_ref, weights_ref, ids_ref, *, num_experts, top_k, renormalize, sigmoid):
    logits = logits_ref[...].astype(jnp.float32)  # [block_rows, padded_experts]
    columns = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    if not sigmoid:
        row_max = jnp.max(logits, axis=1, keepdims=True)  # padding is -inf: it changes nothing
        denom = jnp.sum(jnp.exp(logits - row_max), axis=1, keepdims=True)
    keys = total_order_key(logits)
    slots = jax.lax.broadcasted_iota(jnp.int32, weights_ref.shape, 1)
    padded_experts = logits.shape[1]

    def one_round(i, carry):
        alive, top_weights, top_ids = carry
        best = jnp.max(jnp.where(alive != 0, keys, _INT32_MIN), axis=1, keepdims=True)
        # the lowest alive column holding the best key; one always exists since top_k <= num_experts
        holders = (alive != 0) & (keys == best)
        best_id = jnp.min(jnp.where(holders, columns, padded_experts), axis=1, keepdims=True)
        logit = from_total_order_key(best)
        score = 1.0 / (1.0 + jnp.exp(-logit)) if sigmoid else jnp.exp(logit - row_max) / denom
        top_weights = jnp.where(slots == i, score, top_weights)
        top_ids = jnp.where(slots == i, best_id, top_ids)
        return jnp.where(columns == best_id, 0, alive), top_weights, top_ids

    # a plain loop: the Triton lowering takes a fori_loop only when it is not unrolled
    carry = (
        (columns < num_experts).astype(jnp.int32),
        jnp.zeros(weights_ref.shape, jnp.float32),
        jnp.zeros(ids_ref.shape, jnp.int32),
    )
    _, top_weights, top_ids = jax.lax.fori_loop(0, top_k, one_round, carry)
    if renormalize:  # unused slots hold 0
        top_weights = top_weights / jnp.sum(top_weights, axis=1, keepdims=True)
    weights_ref[...] = top_weights
    ids_ref[...] = top_ids


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "sigmoid", "interpret"))
def _moe_route_gpu(router_logits, top_k, renormalize, sigmoid, interpret):
    from jax.experimental.pallas import triton as plgpu

    tokens, experts = router_logits.shape
    padded_experts, padded_k = pl.next_power_of_2(experts), pl.next_power_of_2(top_k)
    block_rows = max(1, min(64, _TILE_ELEMENTS // padded_experts, pl.next_power_of_2(tokens)))
    padded_tokens = round_up(tokens, block_rows)
    # padding tokens are 0 (finite: their softmax is NaN-free); padding experts -inf (exp gives 0)
    logits = jnp.pad(router_logits, ((0, 0), (0, padded_experts - experts)), constant_values=-jnp.inf)
    logits = pad_to(logits, 0, padded_tokens)
    out_spec = pl.BlockSpec((block_rows, padded_k), lambda i: (i, 0))
    kernel = functools.partial(
        _route_kernel, num_experts=experts, top_k=top_k, renormalize=renormalize, sigmoid=sigmoid
    )
    weights, ids = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.float32),
            jax.ShapeDtypeStruct((padded_tokens, padded_k), jnp.int32),
        ),
        grid=(padded_tokens // block_rows,),
        in_specs=[pl.BlockSpec((block_rows, padded_experts), lambda i: (i, 0))],
        out_specs=(out_spec, out_spec),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(logits)
    return weights[:tokens, :top_k], ids[:tokens, :top_k]


def moe_route_pallas_gpu(router_logits, top_k, renormalize=True, scoring="softmax", *, interpret=None):
    """router_logits [num_tokens, num_experts] f32/f16/bf16 -> (topk_weights float32 [num_tokens,
    top_k], topk_ids int32 [num_tokens, top_k]), highest logit first; the Pallas Triton kernel
    (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    if router_logits.shape[0] == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    return _moe_route_gpu(
        router_logits, top_k=top_k, renormalize=renormalize, sigmoid=scoring == "sigmoid", interpret=interpret
    )


MOE_ROUTE.register_jax("pallas_gpu", moe_route_pallas_gpu)
