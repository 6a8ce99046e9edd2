"""int8_linear as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU): the quantized
GEMMs' tile loop (../scaled_pallas_gpu.py) with 8-bit tiles; fp8_linear runs it with its e4m3 tiles
widened to bfloat16 in registers.

Each K step loads a [block_m, block_k] x tile and a [block_n, block_k] w tile; int8 x int8 goes to
the tensor cores with an int32 accumulator (exact: |sum| < 2^31 for K < 133,000). The epilogue
converts it to float32 and applies acc * x_scale[m] * w_scale[n] (+ bias[n]) before the one rounding
to out_dtype; a per-tensor scale is broadcast to a vector by the wrapper. K is zero-padded to
block_k (zeros add nothing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.int8_linear.pallas_tpu import empty_or
from kiln.ops.gemm.int8_linear.spec import INT8_LINEAR
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.gemm.scaled_pallas_gpu import CONTRACT_LAST, check_tiles, tiled_gemm_gpu, w_panel, x_panel
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up


def _step(kk, acc, x_ref, w_ref, *_, block_k: int, widen):
    start = pl.multiple_of(kk * block_k, block_k)
    x, w = x_ref[:, pl.ds(start, block_k)], w_ref[:, pl.ds(start, block_k)]
    if widen is not None:
        x, w = x.astype(widen), w.astype(widen)
    return acc + jax.lax.dot_general(x, w, CONTRACT_LAST, preferred_element_type=acc.dtype)


def _epilogue(acc, x_ref, w_ref, xs_ref, ws_ref, *bias_ref):
    out = acc.astype(jnp.float32) * xs_ref[...][:, None] * ws_ref[...][None, :]
    if bias_ref:
        out = out + bias_ref[0][...][None, :]
    return out


@functools.partial(jax.jit, static_argnames=("out_dtype", "widen", "tiles", "interpret"))
def scaled_gemm_gpu(x_q, x_scale, w_q, w_scale, bias, out_dtype, widen, tiles, interpret):
    """(x_q [M, K] @ w_q [N, K]^T) * x_scale * w_scale^T (+ bias) -> [M, N] in out_dtype. 8-bit
    operands; `widen` None multiplies them as they are (int8: int32 accumulation), else in `widen`
    (float32 accumulation)."""
    (m, k), n = x_q.shape, w_q.shape[0]
    block_k = min(128, max(32, pl.next_power_of_2(k)))  # 8-bit MMA steps are 32 deep
    kp = round_up(k, block_k)
    operands = [
        x_panel(pad_to(x_q, 1, kp)),
        w_panel(pad_to(w_q, 1, kp)),
        x_panel(jnp.broadcast_to(x_scale.astype(jnp.float32).reshape(-1), (m,))),
        w_panel(jnp.broadcast_to(w_scale.astype(jnp.float32).reshape(-1), (n,))),
    ]
    if bias is not None:
        operands.append(w_panel(bias.astype(jnp.float32)))
    return tiled_gemm_gpu(
        functools.partial(_step, block_k=block_k, widen=widen),
        _epilogue,
        operands,
        m=m,
        n=n,
        num_k=kp // block_k,
        acc_dtype=jnp.int32 if widen is None else jnp.float32,
        out_dtype=out_dtype,
        tiles=tiles,
        interpret=interpret,
    )


def int8_linear_pallas_gpu(
    x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=jnp.bfloat16, *, tiles=None, interpret=None
):
    """int8 x int8 with int32 accumulation, the scales in the epilogue (shapes: spec.py). `tiles`
    (block_m, block_n) overrides the default output tile."""
    interpret = gpu_interpret() if interpret is None else interpret
    out_dtype = jnp_dtype(out_dtype)
    tiles = check_tiles("int8_linear", tiles)

    def kernel():
        return scaled_gemm_gpu(x_int8, x_scale, w_int8, w_scale, bias, out_dtype, None, tiles, interpret)

    return empty_or(kernel, x_int8, w_int8, bias, out_dtype)


INT8_LINEAR.register_jax("pallas_gpu", int8_linear_pallas_gpu)
