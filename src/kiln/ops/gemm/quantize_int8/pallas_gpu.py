"""quantize_int8 as a row-wise Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU);
quantize_fp8 runs the same kernel with e4m3 output.

Grid (M / rows,): a program holds `rows` whole rows, K zero-padded to the next power of two (Triton's
rule; zeros do not change the amax). It takes each row's amax in float32, scale = max(amax, 1e-12) /
qmax, and writes the rounded x / scale and the scale (a [rows] vector, reshaped to [M, 1] outside).
With `given_scale` the scale comes in instead (quantize_fp8's per-tensor mode: the row scales of this
kernel, maxed by XLA, then a second pass). `rows` is a power of two sized so a program holds about
ROW_BLOCK_ELEMENTS values (one row when K is larger).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.quantize_int8.spec import QUANTIZE_INT8
from kiln.ops.gemm.quantize_int8.xla import round_half_away
from kiln.ops.gemm.scaled import AMAX_FLOOR, INT8_MAX
from kiln.ops.jax_div_rn import div_rn
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up

ROW_BLOCK_ELEMENTS = 4096


def _kernel(*refs, qmax: float, out_dtype, given_scale: bool, round_away: bool, compiled: str | None):
    if given_scale:
        x_ref, scale_in_ref, q_ref, s_ref = refs
        scale = scale_in_ref[...][:, None]
    else:
        x_ref, q_ref, s_ref = refs
    x = x_ref[...].astype(jnp.float32)
    if not given_scale:
        amax = jnp.maximum(jnp.max(jnp.abs(x), axis=1, keepdims=True), AMAX_FLOOR)
        scale = div_rn(amax, qmax, compiled=compiled)
    v = div_rn(x, scale, compiled=compiled)
    if round_away:
        v = round_half_away(v)
    q_ref[...] = jnp.clip(v, -qmax, qmax).astype(out_dtype)
    s_ref[...] = scale[:, 0]


@functools.partial(jax.jit, static_argnames=("qmax", "out_dtype", "round_away", "interpret"))
def quantize_rows_gpu(x, scale, qmax: float, out_dtype, round_away: bool, interpret):
    """x [M, K] -> (q [M, K] out_dtype, scale float32 [M, 1]); `scale` None (per row) or float32 [1]."""
    from jax.experimental.pallas import triton as plgpu

    m, k = x.shape
    kp = pl.next_power_of_2(k)
    rows = max(1, min(pl.next_power_of_2(m), ROW_BLOCK_ELEMENTS // kp))
    mp = round_up(m, rows)
    operands = [pad_to(pad_to(x, 0, mp), 1, kp)]
    row_spec, scale_spec = pl.BlockSpec((rows, kp), lambda i: (i, 0)), pl.BlockSpec((rows,), lambda i: (i,))
    in_specs = [row_spec]
    if scale is not None:
        operands.append(jnp.broadcast_to(scale.astype(jnp.float32).reshape(1), (mp,)))
        in_specs.append(scale_spec)
    kernel = functools.partial(
        _kernel,
        qmax=qmax,
        out_dtype=out_dtype,
        given_scale=scale is not None,
        round_away=round_away,
        compiled=None if interpret else "triton",
    )
    q, s = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((mp, kp), out_dtype), jax.ShapeDtypeStruct((mp,), jnp.float32)),
        grid=(mp // rows,),
        in_specs=in_specs,
        out_specs=(row_spec, scale_spec),
        compiler_params=plgpu.CompilerParams(num_warps=min(max(rows * kp // 256, 1), 16), num_stages=1),
        interpret=interpret,
    )(*operands)
    return q[:m, :k], s[:m, None]


def quantize_int8_pallas_gpu(x, *, interpret=None):
    """x [M, K] -> (x_int8 [M, K], scale float32 [M, 1]); shapes: spec.py."""
    interpret = gpu_interpret() if interpret is None else interpret
    return quantize_rows_gpu(x, None, INT8_MAX, jnp.int8, True, interpret)


QUANTIZE_INT8.register_jax("pallas_gpu", quantize_int8_pallas_gpu)
