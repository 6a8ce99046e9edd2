"""rotary_embedding as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU). See xla.py
for the layouts and the pair conventions.

Grid (tokens, heads), one program per head row, run once for q and once for k. The program reads
its token's position, loads the cos and sin halves of that cache row, and loads the two members of
every pair as two vectors: NeoX pairs (i, i + r/2) are two contiguous runs of the row, GPT-J pairs
(2i, 2i + 1) the two columns of the row viewed as [D/2, 2]. Triton vectors are powers of two, so the
runs are masked to r/2 lanes and the row is zero-padded to a power of two that holds them. The
output aliases the input, so the dims past rotary_dim are never touched (the two masked stores write
disjoint lanes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import gpu_interpret, pad_to, squeezed
from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING


def _gpu_kernel(positions_ref, cache_ref, x_ref, o_ref, *, half, lanes, is_neox):
    from jax.experimental.pallas import triton as plgpu

    position = positions_ref[pl.program_id(0)]
    mask = jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0) < half
    cos = plgpu.load(cache_ref.at[position, pl.ds(0, lanes)], mask=mask, other=0.0).astype(jnp.float32)
    sin = plgpu.load(cache_ref.at[position, pl.ds(half, lanes)], mask=mask, other=0.0).astype(jnp.float32)
    if is_neox:  # the row as [1, width]: runs [0, half) and [half, 2 * half)
        first_run, second_run = (jnp.int32(0), pl.ds(0, lanes)), (jnp.int32(0), pl.ds(half, lanes))
    else:  # the row as [width / 2, 2]: pair i is row i, its members columns 0 and 1
        first_run, second_run = (pl.ds(0, lanes), jnp.int32(0)), (pl.ds(0, lanes), jnp.int32(1))
    x1 = plgpu.load(x_ref.at[first_run], mask=mask, other=0.0).astype(jnp.float32)
    x2 = plgpu.load(x_ref.at[second_run], mask=mask, other=0.0).astype(jnp.float32)
    plgpu.store(o_ref.at[first_run], (x1 * cos - x2 * sin).astype(o_ref.dtype), mask=mask)
    plgpu.store(o_ref.at[second_run], (x2 * cos + x1 * sin).astype(o_ref.dtype), mask=mask)


def _rotate(positions, cache, x, half, is_neox, interpret):
    """x [T, H, D] -> x with its first 2 * half dims of every head rotated (one pallas_call); cache
    [max_position, >= half + lanes] holds cos in columns [0, half), sin in [half, 2 * half)."""
    from jax.experimental.pallas import triton as plgpu

    tokens, heads, head_dim = x.shape
    lanes = pl.next_power_of_2(half)
    # A power of two holding the row and every run (NeoX's second run ends at half + lanes).
    width = max(pl.next_power_of_2(head_dim), pl.next_power_of_2(half + lanes), 2)
    row = (1, width) if is_neox else (width // 2, 2)
    row_spec = pl.BlockSpec((squeezed(), squeezed(), *row), lambda t, h: (t, h, 0, 0))
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, half=half, lanes=lanes, is_neox=is_neox),
        out_shape=jax.ShapeDtypeStruct((tokens, heads, *row), x.dtype),
        grid=(tokens, heads),
        in_specs=[pl.no_block_spec, pl.no_block_spec, row_spec],
        out_specs=row_spec,
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1),
        interpret=interpret,
    )(positions, cache, pad_to(x, 2, width).reshape(tokens, heads, *row))
    return out.reshape(tokens, heads, width)[:, :, :head_dim]


@functools.partial(jax.jit, static_argnames=("is_neox", "interpret"))
def _rope_gpu(positions, q, k, cos_sin_cache, is_neox, interpret):
    half = cos_sin_cache.shape[-1] // 2
    # The sin run starts at column `half` and is `lanes` wide: pad the cache's columns to hold it.
    cache = pad_to(cos_sin_cache, 1, half + pl.next_power_of_2(half))
    positions = positions.astype(jnp.int32)
    rotate = functools.partial(_rotate, positions, cache, half=half, is_neox=is_neox, interpret=interpret)
    return rotate(q), rotate(k)


def rotary_embedding_pallas_gpu(positions, q, k, cos_sin_cache, is_neox: bool = True, *, interpret=None):
    """Returns the rotated (q, k); the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    if q.shape[0] == 0:
        return q, k
    return _rope_gpu(positions, q, k, cos_sin_cache, is_neox=bool(is_neox), interpret=interpret)


ROTARY_EMBEDDING.register_jax("pallas_gpu", rotary_embedding_pallas_gpu)
