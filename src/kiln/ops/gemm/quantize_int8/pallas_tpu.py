"""quantize_int8 as a row-wise Pallas Mosaic TPU kernel (the TPU interpreter off a TPU); quantize_fp8
runs the same kernel with e4m3 output.

Grid (M / block_rows,): a program holds block_rows whole rows (K zero-padded to 128 lanes: zeros do
not change the amax), takes each row's amax in float32, writes scale = max(amax, 1e-12) / qmax as a
[block_rows, 1] column and the rounded x / scale. With `given_scale` the scale comes in instead of
being computed (quantize_fp8's per-tensor mode: the row amaxes of this kernel, maxed by XLA, then a
second pass). block_rows is a multiple of 32 (int8 / fp8 pack 32 rows per sublane tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.quantize_int8.spec import QUANTIZE_INT8
from kiln.ops.gemm.quantize_int8.xla import round_half_away
from kiln.ops.gemm.scaled import AMAX_FLOOR, INT8_MAX
from kiln.ops.pallas_common import LANES, pad_to, round_up, row_block, tpu_interpret, tpu_params


def _kernel(*refs, qmax: float, out_dtype, given_scale: bool, round_away: bool):
    if given_scale:
        x_ref, scale_in_ref, q_ref, s_ref = refs
        scale = scale_in_ref[...]
    else:
        x_ref, q_ref, s_ref = refs
        x = x_ref[...].astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), AMAX_FLOOR) / qmax
    v = x_ref[...].astype(jnp.float32) / scale
    if round_away:
        v = round_half_away(v)
    q_ref[...] = jnp.clip(v, -qmax, qmax).astype(out_dtype)
    s_ref[...] = jnp.broadcast_to(scale, s_ref.shape)


@functools.partial(jax.jit, static_argnames=("qmax", "out_dtype", "round_away", "interpret"))
def quantize_rows_tpu(x, scale, qmax: float, out_dtype, round_away: bool, interpret):
    """x [M, K] -> (q [M, K] out_dtype, scale float32 [M, 1]); `scale` None (per row) or float32 [1]."""
    m, k = x.shape
    kp = round_up(k, LANES)
    rows = max(32, round_up(row_block(m, kp * 4, jnp.float32), 32))
    mp = round_up(m, rows)
    operands = [pad_to(pad_to(x, 0, mp), 1, kp)]
    in_specs = [pl.BlockSpec((rows, kp), lambda i: (i, 0))]
    if scale is not None:
        operands.append(jnp.broadcast_to(scale.astype(jnp.float32).reshape(1, 1), (mp, 1)))
        in_specs.append(pl.BlockSpec((rows, 1), lambda i: (i, 0)))
    kernel = functools.partial(
        _kernel, qmax=qmax, out_dtype=out_dtype, given_scale=scale is not None, round_away=round_away
    )
    q, s = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((mp, kp), out_dtype), jax.ShapeDtypeStruct((mp, 1), jnp.float32)),
        grid=(mp // rows,),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((rows, kp), lambda i: (i, 0)), pl.BlockSpec((rows, 1), lambda i: (i, 0))),
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(*operands)
    return q[:m, :k], s[:m]


def quantize_int8_pallas_tpu(x, *, interpret=None):
    """x [M, K] -> (x_int8 [M, K], scale float32 [M, 1]); shapes: spec.py."""
    interpret = tpu_interpret() if interpret is None else interpret
    return quantize_rows_tpu(x, None, INT8_MAX, jnp.int8, True, interpret)


QUANTIZE_INT8.register_jax("pallas_tpu", quantize_int8_pallas_tpu)
