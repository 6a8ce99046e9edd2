"""fused_moe as grouped (ragged) expert GEMMs in Pallas Mosaic TPU kernels (the TPU interpreter off a
TPU), in the style of the TPU MoE kernels:

  1. routing layout (XLA, cheap): the (token, slot) pairs sorted by expert (xla.sort_pairs), each
     expert's group padded to whole block_m row tiles, x's rows gathered into that order [Mp, H];
     `tile_expert[t]`, the expert of row tile t, and the experts' float32 weight scales go to the
     kernels as scalar prefetch (SMEM), so a weight BlockSpec's index_map reads the expert of the tile;
  2. kernel 1, grid (row tiles, I / block_n, H / block_k): the tile's rows @ its expert's gate and up
     tiles ([E, 2, I, H] view), two float32 VMEM accumulators, epilogue h = silu(gate * s) * (up * s)
     rounded to x's dtype (as the spec: a model holds h in its dtype);
  3. kernel 2, the same grid over (row tiles, H / block_n, I / block_k): h @ w_down[e]^T * s in float32;
  4. each pair's row scaled by its topk weight and summed onto its token (XLA segment_sum).
A pair with an out-of-range expert id is not placed in any tile and adds nothing. float8 expert
weights are widened to x's dtype in VMEM (exact for bf16 / fp32; the TPU MXU has no fp8 inputs before
v7) and their per-expert scale applied to the accumulator. Padding rows are zeros and never read back.
Every tile is computed, the padding tiles past the last group included (at most one per expert).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision
from kiln.ops.moe.fused_moe.spec import FUSED_MOE
from kiln.ops.moe.fused_moe.xla import sort_pairs
from kiln.ops.pallas_common import LANES, pad_to, round_up, squeezed, sublanes, tpu_interpret, tpu_params


def _kernel(tile_expert_ref, scale_ref, x_ref, *refs, silu_mul: bool, precision):
    w_ref = refs[0]
    up_ref = refs[1] if silu_mul else None
    o_ref, acc_ref = refs[-2 - silu_mul], refs[-1 - silu_mul]
    up_acc_ref = refs[-1] if silu_mul else None
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        if silu_mul:
            up_acc_ref[...] = jnp.zeros_like(up_acc_ref)

    x = x_ref[...]
    acc_ref[...] += dot_weight_rows(x, w_ref[...], precision)
    if silu_mul:
        up_acc_ref[...] += dot_weight_rows(x, up_ref[...], precision)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        scale = scale_ref[tile_expert_ref[pl.program_id(0)]]
        out = acc_ref[...] * scale
        if silu_mul:
            out = jax.nn.silu(out) * (up_acc_ref[...] * scale)
        o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("silu_mul", "out_dtype", "block_m", "interpret"))
def grouped_gemm_tpu(rows, w, tile_expert, scale, silu_mul: bool, out_dtype, block_m: int, interpret):
    """rows [Mp, K] (row tile t belongs to expert tile_expert[t]) @ w[e] [N or 2N, K]^T * scale[e]
    (silu_mul: silu(gate) * up of w viewed [E, 2, N, K]) -> [Mp, N] in out_dtype."""
    mp, k = rows.shape
    experts, n = w.shape[0], w.shape[1] // 2 if silu_mul else w.shape[1]
    block_n, block_k = min(256, round_up(n, LANES)), min(512, round_up(k, LANES))
    np_, kp = round_up(n, block_n), round_up(k, block_k)
    x = pad_to(rows, 1, kp)
    in_specs = [pl.BlockSpec((block_m, block_k), lambda i, j, kk, te, s: (i, kk))]
    if silu_mul:
        halves = pad_to(pad_to(w.reshape(experts, 2, n, k), 2, np_), 3, kp)
        operands = [x, halves, halves]
        in_specs += [  # the gate tile from half 0, the up tile of the same columns from half 1
            pl.BlockSpec(
                (squeezed(), squeezed(), block_n, block_k), lambda i, j, kk, te, s: (te[i], 0, j, kk)
            ),
            pl.BlockSpec(
                (squeezed(), squeezed(), block_n, block_k), lambda i, j, kk, te, s: (te[i], 1, j, kk)
            ),
        ]
    else:
        operands = [x, pad_to(pad_to(w, 1, np_), 2, kp)]
        in_specs.append(pl.BlockSpec((squeezed(), block_n, block_k), lambda i, j, kk, te, s: (te[i], j, kk)))
    accumulators = [pltpu.VMEM((block_m, block_n), jnp.float32)] * (2 if silu_mul else 1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(mp // block_m, np_ // block_n, kp // block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk, te, s: (i, j)),
        scratch_shapes=accumulators,
    )
    kernel = functools.partial(_kernel, silu_mul=silu_mul, precision=gemm_precision(rows.dtype))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid_spec=grid_spec,
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(tile_expert, scale, *operands)
    return out[:, :n]


def tile_layout(topk_ids, num_experts: int, block_m: int):
    """(order [P], token [P], dest [P] row of each sorted pair in the padded layout (Mp for an
    out-of-range pair), tile_expert int32 [Mp / block_m], Mp)."""
    pairs = topk_ids.size
    order, token, group_sizes = sort_pairs(topk_ids, num_experts)
    padded_sizes = -(-group_sizes // block_m) * block_m
    padded_end = jnp.cumsum(padded_sizes)
    padded_start = padded_end - padded_sizes
    start = jnp.cumsum(group_sizes) - group_sizes
    mp = round_up(pairs, block_m) + num_experts * block_m  # >= sum of the padded group sizes
    ids = topk_ids.reshape(-1).astype(jnp.int32)[order]
    valid = (ids >= 0) & (ids < num_experts)
    safe = jnp.where(valid, ids, 0)
    dest = jnp.where(valid, padded_start[safe] + jnp.arange(pairs) - start[safe], mp)
    tile_start = jnp.arange(mp // block_m) * block_m
    tile_expert = jnp.minimum(jnp.searchsorted(padded_end, tile_start, side="right"), num_experts - 1)
    return order, token, dest, tile_expert.astype(jnp.int32), mp


def _scale(scale, experts: int):
    return jnp.ones((experts,), jnp.float32) if scale is None else scale.astype(jnp.float32)


def fused_moe_pallas_tpu(
    x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None, *, block_m=None,
    interpret=None,
):  # fmt: skip
    """Shapes: spec.py. block_m: rows per tile (a sublane multiple for x's dtype, default 16 / 8)."""
    interpret = tpu_interpret() if interpret is None else interpret
    experts = w_gate_up.shape[0]
    block_m = block_m or max(sublanes(x.dtype), 16)
    order, token, dest, tile_expert, mp = tile_layout(topk_ids, experts, block_m)
    rows = jnp.zeros((mp, x.shape[1]), x.dtype).at[dest].set(x[token], mode="drop")
    hidden = grouped_gemm_tpu(
        rows, w_gate_up, tile_expert, _scale(w_gate_up_scale, experts), True, x.dtype, block_m, interpret
    )
    down = grouped_gemm_tpu(
        hidden, w_down, tile_expert, _scale(w_down_scale, experts), False, jnp.float32, block_m, interpret
    )
    pair_out = jnp.take(down, dest, axis=0, mode="fill", fill_value=0.0)
    weight = topk_weights.reshape(-1)[order].astype(jnp.float32)
    out = jax.ops.segment_sum(pair_out * weight[:, None], token, num_segments=x.shape[0])
    return out.astype(x.dtype)


FUSED_MOE.register_jax("pallas_tpu", fused_moe_pallas_tpu)
