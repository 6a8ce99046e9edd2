"""fused_moe as grouped (ragged) expert GEMMs in Pallas Triton kernels (the Pallas interpreter off a
GPU), in the style of the Triton fused-MoE kernel:

  1. routing layout (XLA, cheap), pallas_tpu.tile_layout: the (token, slot) pairs sorted by expert,
     each expert's group padded to whole block_m row tiles, x's rows gathered into that order
     [Mp, Hp]; `tile_expert[t]`, the expert of row tile t;
  2. kernel 1, grid (row tiles, I / block_n): the program reads its tile's expert from tile_expert
     (a whole-array ref read by index: the Triton lowering has no scalar prefetch, so the expert
     cannot steer a BlockSpec) and loops over H in block_k steps, loading that expert's gate and up
     panels of w_gate_up [E, 2I, H] by pointer with masks (the weights are never padded or copied),
     two float32 accumulators; epilogue h = silu(gate * s) * (up * s) rounded to x's dtype;
  3. kernel 2, grid (row tiles, H / block_n): h @ w_down[e]^T * s in float32, the same way;
  4. each pair's row scaled by its topk weight and summed onto its token (XLA segment_sum).
Tiles past the last group (at most one per expert) return at once; their rows are never read back.
A pair with an out-of-range expert id is not placed in any tile and adds nothing. float8 expert
weights are widened to x's dtype in registers (exact for bf16 / fp16 / fp32) and their per-expert
scale applied to the accumulator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision
from kiln.ops.moe.fused_moe.pallas_tpu import tile_layout
from kiln.ops.moe.fused_moe.spec import FUSED_MOE
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up


def _kernel(
    used_tiles_ref, tile_expert_ref, scale_ref, x_ref, w_ref, o_ref,
    *, n: int, k: int, block_n: int, block_k: int, silu_mul: bool,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    tile, j = pl.program_id(0), pl.program_id(1)

    @pl.when(tile < used_tiles_ref[0])
    def _():
        expert = tile_expert_ref[tile]
        rows = j * block_n + jax.lax.broadcasted_iota(jnp.int32, (block_n, block_k), 0)
        columns0 = jax.lax.broadcasted_iota(jnp.int32, (block_n, block_k), 1)
        x_dtype = x_ref.dtype
        precision = gemm_precision(x_dtype)  # IEEE fp32 for fp32 inputs, not TF32

        def panel(start, row_offset, mask):
            """[block_n, block_k] of the expert's weight rows row_offset + rows, widened to x's dtype."""
            ref = w_ref.at[expert, pl.ds(row_offset + j * block_n, block_n), pl.ds(start, block_k)]
            # zeros selected after the widening: the lowering cannot cast an `other=` fill to float8
            return jnp.where(mask, plgpu.load(ref, mask=mask).astype(x_dtype), 0)

        def body(step, accs):
            start = pl.multiple_of(step * block_k, block_k)
            x = x_ref[:, pl.ds(start, block_k)]
            mask = (rows < n) & (start + columns0 < k)  # the weights are not padded
            acc = accs[0] + dot_weight_rows(x, panel(start, 0, mask), precision)
            if not silu_mul:
                return (acc,)
            return acc, accs[1] + dot_weight_rows(x, panel(start, n, mask), precision)

        zeros = jnp.zeros(o_ref.shape, jnp.float32)
        accs = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, body, (zeros, zeros) if silu_mul else (zeros,))
        scale = scale_ref[expert]
        out = accs[0] * scale
        if silu_mul:
            out = jax.nn.silu(out) * (accs[1] * scale)
        o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("silu_mul", "out_dtype", "block_m", "interpret"))
def grouped_gemm_gpu(rows, w, tile_expert, used_tiles, scale, silu_mul: bool, out_dtype, block_m, interpret):
    """rows [Mp, Kp] (row tile t belongs to expert tile_expert[t]; only the first used_tiles[0] tiles
    are computed; columns past w's K are zeros) @ w[e] [N or 2N, K]^T * scale[e] (silu_mul: silu(gate)
    * up, gate rows 0..N-1 of w[e], up rows N..2N-1) -> [Mp, Np] in out_dtype, Np a multiple of
    block_n whose columns past N are zeros."""
    from jax.experimental.pallas import triton as plgpu

    mp, kp = rows.shape
    k = w.shape[2]
    n = w.shape[1] // 2 if silu_mul else w.shape[1]
    block_n = min(64, max(16, pl.next_power_of_2(n)))
    block_k = min(64, kp)  # kp is a multiple of the largest block_k (see _pad_columns)
    np_ = round_up(n, block_n)
    whole = pl.no_block_spec
    kernel = functools.partial(_kernel, n=n, k=k, block_n=block_n, block_k=block_k, silu_mul=silu_mul)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // block_m, np_ // block_n),
        in_specs=[whole, whole, whole, pl.BlockSpec((block_m, kp), lambda i, j: (i, 0)), whole],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(used_tiles, tile_expert, scale, rows, w)


def _pad_columns(size: int) -> int:
    """A K the kernels' block_k (16..64, a power of two) divides."""
    return round_up(size, min(64, max(16, pl.next_power_of_2(size))))


def fused_moe_pallas_gpu(
    x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None, *, block_m=None,
    interpret=None,
):  # fmt: skip
    """Shapes: spec.py. block_m: rows per tile (a power of two >= 16; default 16 for decode-sized
    batches, up to 64 when the experts get many rows each)."""
    interpret = gpu_interpret() if interpret is None else interpret
    tokens, hidden = x.shape
    experts = w_gate_up.shape[0]
    pairs = topk_ids.size
    block_m = block_m or min(64, max(16, pl.next_power_of_2(pairs // experts)))
    order, token, dest, tile_expert, mp = tile_layout(topk_ids, experts, block_m)
    used_tiles = (jnp.max(jnp.where(dest < mp, dest, -1)) // block_m + 1).astype(jnp.int32)[None]
    rows = jnp.zeros((mp, _pad_columns(hidden)), x.dtype).at[dest, :hidden].set(x[token], mode="drop")
    ones = jnp.ones((experts,), jnp.float32)
    gate_up_scale = ones if w_gate_up_scale is None else w_gate_up_scale.astype(jnp.float32)
    down_scale = ones if w_down_scale is None else w_down_scale.astype(jnp.float32)
    h = grouped_gemm_gpu(
        rows, w_gate_up, tile_expert, used_tiles, gate_up_scale, True, x.dtype, block_m, interpret
    )
    h = pad_to(h, 1, _pad_columns(h.shape[1]))  # a no-op unless block_n < the down GEMM's block_k
    down = grouped_gemm_gpu(
        h, w_down, tile_expert, used_tiles, down_scale, False, jnp.float32, block_m, interpret
    )
    pair_out = jnp.take(down[:, :hidden], dest, axis=0, mode="fill", fill_value=0.0)
    weight = topk_weights.reshape(-1)[order].astype(jnp.float32)
    out = jax.ops.segment_sum(pair_out * weight[:, None], token, num_segments=tokens)
    return out.astype(x.dtype)


FUSED_MOE.register_jax("pallas_gpu", fused_moe_pallas_gpu)
