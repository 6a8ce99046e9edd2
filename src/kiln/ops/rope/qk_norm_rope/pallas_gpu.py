"""qk_norm_rope as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU). See xla.py for the
math.

rotary_embedding's GPU kernel (../../rotary_embedding/pallas_gpu.py) with the RMS norm in front. Grid
(tokens, heads), one program per head row, run once for q (with q_weight) and once for k (k_weight).
The program loads its whole row (zero-padded to a power of two) for mean(x^2) over the D real dims,
stores the normalized, weighted dims past rotary_dim, then loads the two members of every rotary pair
as two vectors (NeoX: two contiguous runs of the row; GPT-J: the two columns of the row viewed as
[width / 2, 2]) with the weight's matching runs, normalizes and rotates them by its token's cos/sin,
and stores them. Float32 throughout, one rounding at the end. The output aliases the input; the three
masked stores write disjoint lanes, after every load.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import gpu_interpret, pad_to, squeezed
from kiln.ops.rope.qk_norm_rope.spec import QK_NORM_ROPE


def _lane_index(shape, is_neox: bool):
    """The head-dim index of every element of the row view ([1, width] or [width / 2, 2])."""
    if is_neox:
        return jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return 2 * jax.lax.broadcasted_iota(jnp.int32, shape, 0) + jax.lax.broadcasted_iota(jnp.int32, shape, 1)


def _kernel(positions_ref, cache_ref, weight_ref, x_ref, o_ref, *, head_dim, half, lanes, eps, is_neox):
    from jax.experimental.pallas import triton as plgpu

    row = x_ref[...].astype(jnp.float32)  # the padded lanes are zero: they add nothing to the sum
    inv_rms = jax.lax.rsqrt(jnp.sum(row * row) / head_dim + eps)
    normed = row * inv_rms * weight_ref[...].astype(jnp.float32)
    plgpu.store(o_ref, normed.astype(o_ref.dtype), mask=_lane_index(row.shape, is_neox) >= 2 * half)

    position = positions_ref[pl.program_id(0)]
    mask = jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0) < half
    cos = plgpu.load(cache_ref.at[position, pl.ds(0, lanes)], mask=mask, other=0.0).astype(jnp.float32)
    sin = plgpu.load(cache_ref.at[position, pl.ds(half, lanes)], mask=mask, other=0.0).astype(jnp.float32)
    if is_neox:  # the row as [1, width]: runs [0, half) and [half, 2 * half)
        first_run, second_run = (jnp.int32(0), pl.ds(0, lanes)), (jnp.int32(0), pl.ds(half, lanes))
    else:  # the row as [width / 2, 2]: pair i is row i, its members columns 0 and 1
        first_run, second_run = (pl.ds(0, lanes), jnp.int32(0)), (pl.ds(0, lanes), jnp.int32(1))

    def normed_run(run):
        x = plgpu.load(x_ref.at[run], mask=mask, other=0.0).astype(jnp.float32)
        return x * inv_rms * plgpu.load(weight_ref.at[run], mask=mask, other=0.0).astype(jnp.float32)

    y1, y2 = normed_run(first_run), normed_run(second_run)
    plgpu.store(o_ref.at[first_run], (y1 * cos - y2 * sin).astype(o_ref.dtype), mask=mask)
    plgpu.store(o_ref.at[second_run], (y2 * cos + y1 * sin).astype(o_ref.dtype), mask=mask)


def _norm_rotate(positions, cache, x, weight, half, eps, is_neox, interpret):
    """x [T, H, D] -> every head RMS-normalized, scaled by weight [D], its first 2 * half dims rotated
    (one pallas_call); cache [max_position, >= half + lanes]: cos in [0, half), sin in [half, 2 half)."""
    from jax.experimental.pallas import triton as plgpu

    tokens, heads, head_dim = x.shape
    lanes = pl.next_power_of_2(half)
    # A power of two holding the row and every run (NeoX's second run ends at half + lanes).
    width = max(pl.next_power_of_2(head_dim), pl.next_power_of_2(half + lanes), 2)
    row = (1, width) if is_neox else (width // 2, 2)
    row_spec = pl.BlockSpec((squeezed(), squeezed(), *row), lambda t, h: (t, h, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, head_dim=head_dim, half=half, lanes=lanes, eps=eps, is_neox=is_neox),
        out_shape=jax.ShapeDtypeStruct((tokens, heads, *row), x.dtype),
        grid=(tokens, heads),
        in_specs=[pl.no_block_spec, pl.no_block_spec, pl.no_block_spec, row_spec],
        out_specs=row_spec,
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1),
        interpret=interpret,
    )(
        positions,
        cache,
        pad_to(weight, 0, width).reshape(row),
        pad_to(x, 2, width).reshape(tokens, heads, *row),
    )
    return out.reshape(tokens, heads, width)[:, :, :head_dim]


@functools.partial(jax.jit, static_argnames=("eps", "is_neox", "interpret"))
def _qk_norm_rope_gpu(positions, q, k, q_weight, k_weight, cos_sin_cache, eps, is_neox, interpret):
    half = cos_sin_cache.shape[-1] // 2
    # The sin run starts at column `half` and is `lanes` wide: pad the cache's columns to hold it.
    cache = pad_to(cos_sin_cache, 1, half + pl.next_power_of_2(half))
    norm_rotate = functools.partial(
        _norm_rotate, positions.astype(jnp.int32), cache, half=half, eps=eps, is_neox=is_neox,
        interpret=interpret,
    )  # fmt: skip
    return norm_rotate(q, q_weight), norm_rotate(k, k_weight)


def qk_norm_rope_pallas_gpu(
    positions, q, k, q_weight, k_weight, cos_sin_cache, eps: float = 1e-6, is_neox: bool = True,
    *, interpret=None,
):  # fmt: skip
    """Returns the normalized and rotated (q, k); the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    if q.shape[0] == 0:
        return q, k
    return _qk_norm_rope_gpu(
        positions, q, k, q_weight, k_weight, cos_sin_cache, eps=float(eps), is_neox=bool(is_neox),
        interpret=interpret,
    )  # fmt: skip


QK_NORM_ROPE.register_jax("pallas_gpu", qk_norm_rope_pallas_gpu)
