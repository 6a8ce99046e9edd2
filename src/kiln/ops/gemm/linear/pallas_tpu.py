"""linear as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU); linear_silu_mul and
w8a16_linear run the same kernel with their epilogues (see xla.py for the math).

Tiling: the grid is (M / block_m, N / block_n, K / block_k) with K innermost ("arbitrary": it
revisits the same output block); each program adds x_tile @ w_tile^T into a float32 VMEM
accumulator and the last K step applies the epilogue and writes the output tile once. M, N, K are
zero-padded to the blocks (zeros add nothing to the dot), the result sliced. Blocks: block_m a
sublane multiple (16 covers bf16; int8's 32-row packing is met by block_n >= 128 on the weight
rows), block_n and block_k multiples of 128 lanes. int8 weights are widened to x's dtype inside the
kernel (exact: |w| <= 127 fits bf16's 8-bit significand), so HBM traffic stays one byte per weight.
With silu_mul the [2N, K] weight is viewed as [2, N, K]: the program reads the gate and the up tile
of the same output columns and keeps a second accumulator, so the [M, 2N] product never leaves VMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.gemm.linear.spec import LINEAR
from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision, over_rows
from kiln.ops.pallas_common import LANES, pad_to, round_up, squeezed, sublanes, tpu_interpret, tpu_params


def _kernel(*refs, has_scale: bool, has_bias: bool, silu_mul: bool, precision):
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    up_ref = refs.pop(0) if silu_mul else None
    scale_ref = refs.pop(0) if has_scale else None
    bias_ref = refs.pop(0) if has_bias else None
    o_ref, acc_ref = refs.pop(0), refs.pop(0)
    up_acc_ref = refs.pop(0) if silu_mul else None
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
        out = acc_ref[...]
        if has_scale:
            out = out * scale_ref[...]
        if has_bias:
            out = out + bias_ref[...].astype(jnp.float32)
        if silu_mul:
            out = out * jax.nn.sigmoid(out) * up_acc_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def default_blocks(m: int, n: int, k: int, dtype) -> tuple[int, int, int]:
    """(block_m, block_n, block_k): big enough to feed the MXU, small enough to keep padding low."""
    block_m = min(256, round_up(m, max(sublanes(dtype), 16)))
    block_n = min(256, round_up(n, LANES))
    block_k = min(512, round_up(k, LANES))
    return block_m, block_n, block_k


@functools.partial(jax.jit, static_argnames=("silu_mul", "blocks", "interpret"))
def gemm_tpu(x, w, scale, bias, silu_mul: bool, blocks, interpret):
    """x [M, K] @ w [N or 2N, K]^T with xla.py's epilogues -> [M, N] in x's dtype."""
    (m, k), n = x.shape, w.shape[0] // 2 if silu_mul else w.shape[0]
    block_m, block_n, block_k = blocks or default_blocks(m, n, k, x.dtype)
    mp, np_, kp = round_up(m, block_m), round_up(n, block_n), round_up(k, block_k)
    operands = [pad_to(pad_to(x, 0, mp), 1, kp)]
    in_specs = [pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk))]
    if silu_mul:  # [2, N, K]: the gate tile from half 0, the up tile of the same columns from half 1
        halves = pad_to(pad_to(w.reshape(2, n, k), 1, np_), 2, kp)
        operands += [halves, halves]
        in_specs += [
            pl.BlockSpec((squeezed(), block_n, block_k), lambda i, j, kk: (0, j, kk)),
            pl.BlockSpec((squeezed(), block_n, block_k), lambda i, j, kk: (1, j, kk)),
        ]
    else:
        operands.append(pad_to(pad_to(w, 0, np_), 1, kp))
        in_specs.append(pl.BlockSpec((block_n, block_k), lambda i, j, kk: (j, kk)))
    row_spec = pl.BlockSpec((1, block_n), lambda i, j, kk: (0, j))
    for vector in (scale, bias):
        if vector is not None:
            operands.append(pad_to(vector.reshape(1, n), 1, np_))
            in_specs.append(row_spec)
    accumulators = [pltpu.VMEM((block_m, block_n), jnp.float32)] * (2 if silu_mul else 1)
    kernel = functools.partial(
        _kernel,
        has_scale=scale is not None,
        has_bias=bias is not None,
        silu_mul=silu_mul,
        precision=gemm_precision(x.dtype),
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        grid=(mp // block_m, np_ // block_n, kp // block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=accumulators,
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


def linear_pallas_tpu(x, weight, bias=None, *, blocks: tuple[int, int, int] | None = None, interpret=None):
    """x [..., K] @ weight[N, K]^T (+ bias [N]); the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret

    def kernel(x2):
        return gemm_tpu(x2, weight, None, bias, silu_mul=False, blocks=blocks, interpret=interpret)

    return over_rows(kernel, x, weight.shape[0], bias)


LINEAR.register_jax("pallas_tpu", linear_pallas_tpu)
