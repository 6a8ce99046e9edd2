"""The Pallas Triton (GPU) rotary kernel of rotary_embedding and qk_norm_rope (the GPU counterpart of
jax_common.rope_tpu): rotary_embedding rotates, qk_norm_rope RMS-normalizes each head by a weight
first.

Grid (tokens, heads), one program per head row, run once for q and once for k. The program reads its
token's position, loads the cos and sin halves of that cache row, and loads the two members of every
pair as two vectors: NeoX pairs (i, i + r/2) are two contiguous runs of the row, GPT-J pairs
(2i, 2i + 1) the two columns of the row viewed as [width / 2, 2]. Triton vectors are powers of two,
so the runs are masked to r/2 lanes and the row is zero-padded to a power of two that holds them.
With a norm weight the program first loads its whole row for mean(x^2) over the D real dims and
stores the normalized, weighted dims past rotary_dim; the runs are normalized and weighted as they are
loaded. Float32 throughout, one rounding at the end. The output aliases the input, so without a norm
the dims past rotary_dim are never touched; the masked stores write disjoint lanes, after every load.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import pad_to, squeezed


def _lane_index(shape, is_neox: bool):
    """The head-dim index of every element of the row view ([1, width] or [width / 2, 2])."""
    if is_neox:
        return jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return 2 * jax.lax.broadcasted_iota(jnp.int32, shape, 0) + jax.lax.broadcasted_iota(jnp.int32, shape, 1)


def _kernel(positions_ref, cache_ref, *refs, head_dim, half, lanes, eps, is_neox, normalize):
    from jax.experimental.pallas import triton as plgpu

    weight_ref, x_ref, o_ref = refs if normalize else (None, *refs)
    if normalize:
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

    def load_run(run):
        x = plgpu.load(x_ref.at[run], mask=mask, other=0.0).astype(jnp.float32)
        if not normalize:
            return x
        return x * inv_rms * plgpu.load(weight_ref.at[run], mask=mask, other=0.0).astype(jnp.float32)

    x1, x2 = load_run(first_run), load_run(second_run)
    plgpu.store(o_ref.at[first_run], (x1 * cos - x2 * sin).astype(o_ref.dtype), mask=mask)
    plgpu.store(o_ref.at[second_run], (x2 * cos + x1 * sin).astype(o_ref.dtype), mask=mask)


def _rotate(positions, cache, x, weight, half, eps, is_neox, interpret):
    """x [T, H, D] -> every head (RMS-normalized and scaled by weight [D] when given) with its first
    2 * half dims rotated (one pallas_call); cache [max_position, >= half + lanes]: cos in [0, half),
    sin in [half, 2 * half)."""
    from jax.experimental.pallas import triton as plgpu

    tokens, heads, head_dim = x.shape
    lanes = pl.next_power_of_2(half)
    # A power of two holding the row and every run (NeoX's second run ends at half + lanes).
    width = max(pl.next_power_of_2(head_dim), pl.next_power_of_2(half + lanes), 2)
    row = (1, width) if is_neox else (width // 2, 2)
    row_spec = pl.BlockSpec((squeezed(), squeezed(), *row), lambda t, h: (t, h, 0, 0))
    operands = [positions, cache]
    if weight is not None:
        operands.append(pad_to(weight, 0, width).reshape(row))
    operands.append(pad_to(x, 2, width).reshape(tokens, heads, *row))
    kernel = functools.partial(
        _kernel, head_dim=head_dim, half=half, lanes=lanes, eps=eps, is_neox=is_neox,
        normalize=weight is not None,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tokens, heads, *row), x.dtype),
        grid=(tokens, heads),
        in_specs=[pl.no_block_spec] * (len(operands) - 1) + [row_spec],
        out_specs=row_spec,
        input_output_aliases={len(operands) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1),
        interpret=interpret,
    )(*operands)
    return out.reshape(tokens, heads, width)[:, :, :head_dim]


@functools.partial(jax.jit, static_argnames=("eps", "is_neox", "interpret"))
def rope_gpu(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, is_neox, interpret):
    """(q, k) [T, H(kv), D] rotated by positions [T] through cos_sin_cache [max_position, rotary_dim]
    (cos then sin), each head first RMS-normalized (eps) and scaled by q_weight / k_weight [D] when
    those are given (None for both: rotation only)."""
    half = cos_sin_cache.shape[-1] // 2
    # The sin run starts at column `half` and is `lanes` wide: pad the cache's columns to hold it.
    cache = pad_to(cos_sin_cache, 1, half + pl.next_power_of_2(half))
    rotate = functools.partial(
        _rotate, positions.astype(jnp.int32), cache, half=half, eps=eps, is_neox=is_neox, interpret=interpret
    )
    return rotate(q, q_weight), rotate(k, k_weight)
