"""int8_linear as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU); fp8_linear runs the same
kernel with its operands widened in VMEM.

Tiling as linear's (../linear/pallas_tpu.py): grid (M / block_m, N / block_n, K / block_k), K innermost
("arbitrary"). int8 tiles go to the MXU as int8 x int8 with an int32 VMEM accumulator (exact: the
sum stays below 2^31 for K < 133,000); the last K step converts it to float32 and applies the epilogue
acc * x_scale[m] * w_scale[n] (+ bias[n]) before the one rounding to out_dtype. The scales arrive as
a [block_m, 1] column and a [1, block_n] row; a per-tensor scale is broadcast by the wrapper. Blocks:
block_m a multiple of 32 (int8 packs 32 rows per sublane tile), block_n and block_k of 128 lanes;
M, N, K zero-padded (zeros add nothing), the result sliced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.gemm.int8_linear.spec import INT8_LINEAR
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.pallas_common import LANES, pad_to, round_up, tpu_interpret, tpu_params

CONTRACT_LAST = (((1,), (1,)), ((), ()))


def _kernel(x_ref, xs_ref, w_ref, ws_ref, *refs, has_bias: bool, widen, acc_dtype):
    bias_ref = refs[0] if has_bias else None
    o_ref, acc_ref = refs[-2], refs[-1]
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x, w = x_ref[...], w_ref[...]
    if widen is not None:
        x, w = x.astype(widen), w.astype(widen)
    acc_ref[...] += jax.lax.dot_general(x, w, CONTRACT_LAST, preferred_element_type=acc_dtype)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        out = acc_ref[...].astype(jnp.float32) * xs_ref[...] * ws_ref[...]
        if has_bias:
            out = out + bias_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def scaled_blocks(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(block_m, block_n, block_k) for 8-bit operands: 32-row multiples, 128-lane multiples."""
    return min(256, round_up(m, 32)), min(256, round_up(n, LANES)), min(512, round_up(k, LANES))


@functools.partial(jax.jit, static_argnames=("out_dtype", "widen", "blocks", "interpret"))
def scaled_gemm_tpu(x_q, x_scale, w_q, w_scale, bias, out_dtype, widen, blocks, interpret):
    """(x_q [M, K] @ w_q [N, K]^T) * x_scale * w_scale^T (+ bias) -> [M, N] in out_dtype. 8-bit
    operands; `widen` None multiplies them as they are (int8: int32 accumulation), else in `widen`
    (float32 accumulation)."""
    (m, k), n = x_q.shape, w_q.shape[0]
    block_m, block_n, block_k = blocks or scaled_blocks(m, n, k)
    mp, np_, kp = round_up(m, block_m), round_up(n, block_n), round_up(k, block_k)
    xs = jnp.broadcast_to(x_scale.astype(jnp.float32).reshape(-1, 1), (m, 1))
    ws = jnp.broadcast_to(w_scale.astype(jnp.float32).reshape(1, -1), (1, n))
    operands = [pad_to(pad_to(x_q, 0, mp), 1, kp), pad_to(xs, 0, mp), pad_to(pad_to(w_q, 0, np_), 1, kp)]
    operands.append(pad_to(ws, 1, np_))
    row_spec = pl.BlockSpec((1, block_n), lambda i, j, kk: (0, j))
    in_specs = [
        pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((block_m, 1), lambda i, j, kk: (i, 0)),
        pl.BlockSpec((block_n, block_k), lambda i, j, kk: (j, kk)),
        row_spec,
    ]
    if bias is not None:
        operands.append(pad_to(bias.astype(jnp.float32).reshape(1, n), 1, np_))
        in_specs.append(row_spec)
    acc_dtype = jnp.int32 if widen is None else jnp.float32
    kernel = functools.partial(_kernel, has_bias=bias is not None, widen=widen, acc_dtype=acc_dtype)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // block_m, np_ // block_n, kp // block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), acc_dtype)],
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


def empty_or(kernel, x_q, w_q, bias, out_dtype):
    """kernel() unless M, N or K is zero (then the bias or zeros, no launch)."""
    (m, k), n = x_q.shape, w_q.shape[0]
    if m == 0 or n == 0 or k == 0:
        zeros = jnp.zeros((m, n), jnp.float32)
        return (zeros if bias is None else zeros + bias.astype(jnp.float32)).astype(out_dtype)
    return kernel()


def int8_linear_pallas_tpu(
    x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=jnp.bfloat16, *, blocks=None, interpret=None
):
    """int8 x int8 on the MXU, int32 accumulation, the scales in the epilogue (shapes: spec.py)."""
    interpret = tpu_interpret() if interpret is None else interpret
    out_dtype = jnp_dtype(out_dtype)

    def kernel():
        return scaled_gemm_tpu(x_int8, x_scale, w_int8, w_scale, bias, out_dtype, None, blocks, interpret)

    return empty_or(kernel, x_int8, w_int8, bias, out_dtype)


INT8_LINEAR.register_jax("pallas_tpu", int8_linear_pallas_tpu)
