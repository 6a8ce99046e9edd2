"""Pallas matmuls (TPU and GPU) in the checkpoint's [out, in] weight layout, on JAX arrays.

    matmul:  x [M, K] f32/f16/bf16, w [N, K] same dtype, bias [N] | None -> x @ w^T + bias  [M, N]
    w8a16:   x [M, K] f32/f16/bf16, w int8 [N, K], scale f32 [N] (per output channel), bias [N] | None
             -> (x @ w^T) * scale + bias  [M, N], x's dtype

Tiling (Mosaic): the grid is (M / block_m, N / block_n, K / block_k) with K innermost ("arbitrary":
it revisits the same output block), each program adds x_tile @ w_tile^T into a float32 VMEM
accumulator and the last K step applies scale/bias and writes the output tile once. M, N, K are
zero-padded to the blocks (zeros add nothing to the dot), the result sliced. Blocks: block_m a
sublane multiple (16 covers bf16 and int8's 32-row packing is met by block_n >= 128 on the weight
rows), block_n and block_k multiples of 128 lanes. int8 weights are widened to x's dtype inside the
kernel (exact: |w| <= 127 fits bf16's 8-bit significand), so HBM traffic stays one byte per weight.

GPU (Triton lowering): grid (M / block_m, N / block_n); each program loops over K in block_k steps
(fori_loop over pl.ds slices of its row panels) with a float32 register accumulator. Blocks are
powers of two (Triton's rule); fp32 inputs use IEEE fp32 dots (no TF32), to meet the fp32 tolerance.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.pallas_common import LANES, gpu_interpret, pad_to, round_up, sublanes, tpu_interpret, tpu_params


def _kernel(*refs, has_scale: bool, has_bias: bool, precision):
    x_ref, w_ref = refs[0], refs[1]
    rest = list(refs[2:])
    scale_ref = rest.pop(0) if has_scale else None
    bias_ref = rest.pop(0) if has_bias else None
    o_ref, acc_ref = rest
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    w = w_ref[...].astype(x.dtype)
    # Contract the last dims of both tiles: x_tile @ w_tile^T without materializing a transpose.
    acc_ref[...] += jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        out = acc_ref[...]
        if has_scale:
            out = out * scale_ref[...]
        if has_bias:
            out = out + bias_ref[...].astype(jnp.float32)
        o_ref[...] = out.astype(o_ref.dtype)


def default_blocks(m: int, n: int, k: int, dtype) -> tuple[int, int, int]:
    """(block_m, block_n, block_k): big enough to feed the MXU, small enough to keep padding low."""
    block_m = min(256, round_up(m, max(sublanes(dtype), 16)))
    block_n = min(256, round_up(n, LANES))
    block_k = min(512, round_up(k, LANES))
    return block_m, block_n, block_k


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _matmul_tpu(x, w, scale, bias, blocks, interpret):
    (m, k), n = x.shape, w.shape[0]
    block_m, block_n, block_k = blocks or default_blocks(m, n, k, x.dtype)
    mp, np_, kp = round_up(m, block_m), round_up(n, block_n), round_up(k, block_k)
    operands = [pad_to(pad_to(x, 0, mp), 1, kp), pad_to(pad_to(w, 0, np_), 1, kp)]
    in_specs = [
        pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((block_n, block_k), lambda i, j, kk: (j, kk)),
    ]
    row_spec = pl.BlockSpec((1, block_n), lambda i, j, kk: (0, j))
    for vector in (scale, bias):
        if vector is not None:
            operands.append(pad_to(vector.reshape(1, n), 1, np_))
            in_specs.append(row_spec)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = pl.pallas_call(
        functools.partial(
            _kernel, has_scale=scale is not None, has_bias=bias is not None, precision=precision
        ),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        grid=(mp // block_m, np_ // block_n, kp // block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


def matmul_pallas_tpu(x, w, bias=None, *, blocks: tuple[int, int, int] | None = None, interpret=None):
    """x [M, K] @ w[N, K]^T (+ bias [N]); the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    return _matmul_tpu(x, w, None, bias, blocks=blocks, interpret=interpret)


def w8a16_pallas_tpu(
    x, w_int8, scale, bias=None, *, blocks: tuple[int, int, int] | None = None, interpret=None
):
    """(x [M, K] @ w_int8[N, K]^T) * scale[N] (+ bias [N]); the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    return _matmul_tpu(x, w_int8, scale.astype(jnp.float32), bias, blocks=blocks, interpret=interpret)


def _gpu_kernel(*refs, has_scale: bool, has_bias: bool, block_k: int, num_k: int):
    x_ref, w_ref = refs[0], refs[1]
    rest = list(refs[2:])
    scale_ref = rest.pop(0) if has_scale else None
    bias_ref = rest.pop(0) if has_bias else None
    (o_ref,) = rest

    def body(kk, acc):
        start = pl.multiple_of(kk * block_k, block_k)
        x = x_ref[:, pl.ds(start, block_k)]
        w = w_ref[:, pl.ds(start, block_k)].astype(x.dtype)
        precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None  # IEEE fp32, not TF32
        return acc + jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        )

    acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    if has_scale:
        acc = acc * scale_ref[...][None, :]
    if has_bias:
        acc = acc + bias_ref[...][None, :].astype(jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _matmul_gpu(x, w, scale, bias, blocks, interpret):
    from jax.experimental.pallas import triton as plgpu

    (m, k), n = x.shape, w.shape[0]
    block_m, block_n, block_k = blocks or (
        min(64, max(16, pl.next_power_of_2(m))),
        min(128, max(16, pl.next_power_of_2(n))),
        min(64, max(16, pl.next_power_of_2(k))),
    )
    mp, np_, kp = round_up(m, block_m), round_up(n, block_n), round_up(k, block_k)
    operands = [pad_to(pad_to(x, 0, mp), 1, kp), pad_to(pad_to(w, 0, np_), 1, kp)]
    in_specs = [
        pl.BlockSpec((block_m, kp), lambda i, j: (i, 0)),  # row panels; the kernel loads block_k slices
        pl.BlockSpec((block_n, kp), lambda i, j: (j, 0)),
    ]
    for vector in (scale, bias):
        if vector is not None:
            operands.append(pad_to(vector, 0, np_))
            in_specs.append(pl.BlockSpec((block_n,), lambda i, j: (j,)))
    kernel = functools.partial(
        _gpu_kernel,
        has_scale=scale is not None,
        has_bias=bias is not None,
        block_k=block_k,
        num_k=kp // block_k,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
        grid=(mp // block_m, np_ // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


def matmul_pallas_gpu(x, w, bias=None, *, blocks: tuple[int, int, int] | None = None, interpret=None):
    """x [M, K] @ w[N, K]^T (+ bias [N]); the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    return _matmul_gpu(x, w, None, bias, blocks=blocks, interpret=interpret)


def w8a16_pallas_gpu(
    x, w_int8, scale, bias=None, *, blocks: tuple[int, int, int] | None = None, interpret=None
):
    """(x [M, K] @ w_int8[N, K]^T) * scale[N] (+ bias); the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    return _matmul_gpu(x, w_int8, scale.astype(jnp.float32), bias, blocks=blocks, interpret=interpret)


@jax.jit
def matmul_xla(x, w, bias=None):
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )
    return (out if bias is None else out + bias.astype(jnp.float32)).astype(x.dtype)


@jax.jit
def w8a16_xla(x, w_int8, scale, bias=None):
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = jax.lax.dot_general(
        x,
        w_int8.astype(x.dtype),
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    out = out * scale.astype(jnp.float32).reshape(1, -1)
    return (out if bias is None else out + bias.astype(jnp.float32)).astype(x.dtype)
