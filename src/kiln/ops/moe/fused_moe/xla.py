"""fused_moe in jax (XLA) as two grouped GEMMs over tokens sorted by expert (jax.lax.ragged_dot):

  1. the (token, slot) pairs sorted by expert id, the group sizes counted per expert; a pair with an
     out-of-range id sorts past every group, so ragged_dot gives it zeros (it adds nothing);
  2. gate_up = ragged_dot(x[pair token], w_gate_up^T), h = silu(gate) * up rounded to x's dtype;
  3. y = ragged_dot(h, w_down^T) * topk_weight, summed back onto the tokens (segment_sum).
float8 expert weights are widened to float32 and scaled by their expert's scale (the GEMMs then run
in float32); otherwise the operands stay in x's dtype with float32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.ops.moe.fused_moe.spec import FUSED_MOE


def expert_weights(w, scale, dtype):
    """[E, rows, cols] in the compute dtype: x's dtype, or float32 * scale[e] for float8 weights."""
    if scale is None:
        return w.astype(dtype)
    return w.astype(jnp.float32) * scale.astype(jnp.float32)[:, None, None]


def sort_pairs(topk_ids, num_experts: int):
    """(order [P] pair indices sorted by expert, token [P] of each sorted pair, group_sizes int32 [E])."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    ids = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # out of range: past every group
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return order, order // top_k, group_sizes


def fused_moe_xla(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None):
    num_experts, intermediate = w_gate_up.shape[0], w_down.shape[2]
    fp8 = w_gate_up_scale is not None or w_down_scale is not None
    compute = jnp.float32 if fp8 else x.dtype
    w_gu = expert_weights(w_gate_up, w_gate_up_scale, compute)
    w_d = expert_weights(w_down, w_down_scale, compute)
    order, token, group_sizes = sort_pairs(topk_ids, num_experts)
    precision = jax.lax.Precision.HIGHEST if compute == jnp.float32 else None
    xs = x[token].astype(compute)
    gate_up = jax.lax.ragged_dot(
        xs, jnp.swapaxes(w_gu, 1, 2), group_sizes, precision=precision, preferred_element_type=jnp.float32
    )
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype).astype(compute)
    down = jax.lax.ragged_dot(
        hidden, jnp.swapaxes(w_d, 1, 2), group_sizes, precision=precision, preferred_element_type=jnp.float32
    )
    weight = topk_weights.reshape(-1)[order].astype(jnp.float32)
    out = jax.ops.segment_sum(down * weight[:, None], token, num_segments=x.shape[0])
    return out.astype(x.dtype)


FUSED_MOE.register_jax("xla", fused_moe_xla)
