"""fp8_block_linear as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU).

x is quantized per token and group of block_k inputs in jax.numpy before the kernel (xla.py's
quantize_groups: the same e4m3 values and float32 scales as the XLA path), so the kernel reads e4m3
x and e4m3 w. Grid (M / tile_m, N / tile_n, K / tile_k), K innermost ("arbitrary"); a K step covers
tile_k / block_k whole weight-block columns. For each group g of the step the kernel multiplies the
group's e4m3 tiles widened to bfloat16 in VMEM (exact; TPU MXUs before v7 take no fp8) with a
float32 result, and accumulates it scaled per group:

    acc[m, n] += (x_q[m, g] . w[n, g]) * x_scale[m, g] * w_scale[n // block_n, g]

then the last K step adds the bias and rounds once to out_dtype. The scales arrive per group as a
[tile_m, 1] column (x) and a [1, tile_n] row (w, expanded from one per block_n rows to one per
output feature, so block_n need not divide the tile). Mosaic tiles are (8|32, 128): block_k >= 128
groups are sliced at 128-lane boundaries; block_k < 128 groups share a 128-lane chunk and are
selected by masking the other lanes of x to zero, one full-width MXU pass per group (128 / block_k
passes per chunk: the price of the small blocks, which the checkpoints do not use). M, N, K are
zero-padded outside the kernel (zero x and zero scales add nothing) and the result is sliced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.gemm.fp8_block_linear.spec import FP8_BLOCK_LINEAR
from kiln.ops.gemm.fp8_block_linear.xla import quantize_groups
from kiln.ops.gemm.int8_linear.pallas_tpu import CONTRACT_LAST, empty_or
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.pallas_common import (
    LANES,
    pad_to,
    round_up,
    store_on_last_k,
    tpu_interpret,
    tpu_params,
    zero_on_first_k,
)

MAX_TILE_K = 512
MAX_GROUPS_PER_STEP = 8  # each group's x-scale column is a [tile_m, 1] VMEM block (lane-padded)


def _kernel(x_ref, xs_ref, w_ref, ws_ref, *refs, has_bias: bool, block_k: int, chunk: int):
    bias_ref = refs[0] if has_bias else None
    o_ref, acc_ref = refs[-2], refs[-1]
    zero_on_first_k(acc_ref)

    acc = acc_ref[...]
    groups_per_chunk = chunk // block_k
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
    for start in range(0, x_ref.shape[1], chunk):
        x = x_ref[:, start : start + chunk].astype(jnp.bfloat16)
        w = w_ref[:, start : start + chunk].astype(jnp.bfloat16)
        for t in range(groups_per_chunk):
            group = start // block_k + t
            x_group = x
            if groups_per_chunk > 1:  # keep only this group's lanes; w needs no mask then
                in_group = (lane >= t * block_k) & (lane < (t + 1) * block_k)
                x_group = jnp.where(in_group, x, jnp.zeros_like(x))
            part = jax.lax.dot_general(x_group, w, CONTRACT_LAST, preferred_element_type=jnp.float32)
            acc = acc + part * xs_ref[group] * ws_ref[group]
    acc_ref[...] = acc

    store_on_last_k(acc_ref, o_ref, bias_ref)


def block_fp8_tiles(m: int, n: int, k: int, block_k: int) -> tuple[int, int, int]:
    """(tile_m, tile_n, tile_k): tile_m a multiple of 32 (e4m3 packs 32 rows per sublane tile), tile_n
    of 128 lanes, tile_k a multiple of max(block_k, 128) with at most MAX_GROUPS_PER_STEP groups."""
    chunk = max(block_k, LANES)
    chunks = min(MAX_TILE_K // chunk, max(1, MAX_GROUPS_PER_STEP * block_k // chunk), -(-k // chunk))
    return min(256, round_up(m, 32)), min(256, round_up(n, LANES)), chunk * max(1, chunks)


def _check_tiles(tiles: tuple[int, int, int], block_k: int) -> None:
    tile_m, tile_n, tile_k = tiles
    chunk = max(block_k, LANES)
    if tile_m % 32 or tile_n % LANES or tile_k % chunk or min(tiles) <= 0:
        raise ValueError(
            f"fp8_block_linear: tiles {tiles}, expected (tile_m % 32, tile_n % 128, tile_k % {chunk}) == 0"
        )


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "out_dtype", "tiles", "interpret"))
def block_fp8_gemm_tpu(x, w_fp8, w_scale, bias, block_n, block_k, out_dtype, tiles, interpret):
    """x [M, K] (quantized here per token and group) times w_fp8 [N, K] e4m3 with w_scale
    [ceil(N/block_n), ceil(K/block_k)] float32 (+ bias [N]) -> [M, N] in out_dtype."""
    (m, k), n = x.shape, w_fp8.shape[0]
    x_q, x_scale = quantize_groups(x, block_k)  # [M, G * block_k] e4m3, [M, G] float32
    tile_m, tile_n, tile_k = tiles
    mp, np_, kp = round_up(m, tile_m), round_up(n, tile_n), round_up(k, tile_k)
    groups = kp // block_k
    # Scales by group on the leading axis, so the kernel indexes a group with a plain ref index.
    xs = pad_to(pad_to(x_scale, 0, mp), 1, groups).T.reshape(groups, mp, 1)
    ws = jnp.repeat(w_scale.astype(jnp.float32), block_n, axis=0)[:n]  # [N, G]: one row per feature
    ws = pad_to(pad_to(ws, 0, np_), 1, groups).T.reshape(groups, 1, np_)
    operands = [pad_to(pad_to(x_q, 0, mp), 1, kp), xs, pad_to(pad_to(w_fp8, 0, np_), 1, kp), ws]
    per_step = tile_k // block_k
    in_specs = [
        pl.BlockSpec((tile_m, tile_k), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((per_step, tile_m, 1), lambda i, j, kk: (kk, i, 0)),
        pl.BlockSpec((tile_n, tile_k), lambda i, j, kk: (j, kk)),
        pl.BlockSpec((per_step, 1, tile_n), lambda i, j, kk: (kk, 0, j)),
    ]
    if bias is not None:
        operands.append(pad_to(bias.astype(jnp.float32).reshape(1, n), 1, np_))
        in_specs.append(pl.BlockSpec((1, tile_n), lambda i, j, kk: (0, j)))
    kernel = functools.partial(_kernel, has_bias=bias is not None, block_k=block_k, chunk=max(block_k, LANES))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // tile_m, np_ // tile_n, kp // tile_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tile_m, tile_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((tile_m, tile_n), jnp.float32)],
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


def fp8_block_linear_pallas_tpu(
    x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=jnp.bfloat16, *, tiles=None, interpret=None
):
    """y = dequant(x_q) @ dequant(w_fp8)^T (+ bias) -> [M, N] in out_dtype; shapes: spec.py. `tiles`
    (tile_m, tile_n, tile_k) overrides block_fp8_tiles."""
    interpret = tpu_interpret() if interpret is None else interpret
    out_dtype = jnp_dtype(out_dtype)
    block_n, block_k = int(block_n), int(block_k)

    def kernel():
        (m, k), n = x.shape, w_fp8.shape[0]
        chosen = tuple(tiles) if tiles is not None else block_fp8_tiles(m, n, k, block_k)
        _check_tiles(chosen, block_k)
        return block_fp8_gemm_tpu(x, w_fp8, w_scale, bias, block_n, block_k, out_dtype, chosen, interpret)

    return empty_or(kernel, x, w_fp8, bias, out_dtype)


FP8_BLOCK_LINEAR.register_jax("pallas_tpu", fp8_block_linear_pallas_tpu)
