"""Pallas kernels for softmax over the last dim, on JAX arrays.

    x [rows, n] f32/f16/bf16 -> softmax(x / temperature) [rows, n], x's dtype, float32 math
    (subtract the row max before exp, so no overflow for any finite input).

`softmax_pallas_tpu` (Mosaic: a program owns `block_rows` full rows, rows padded to the block),
`softmax_pallas_gpu` (Triton lowering: one program per row, n padded to a power of two with -inf,
which exp turns into exact zeros) and `softmax_xla`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up, row_block, squeezed, tpu_interpret, tpu_params


def _softmax_rows(x, inv_temperature: float):
    z = x.astype(jnp.float32) * inv_temperature
    e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _kernel(x_ref, y_ref, *, inv_temperature: float):
    y_ref[...] = _softmax_rows(x_ref[...], inv_temperature).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("inv_temperature", "interpret"))
def _softmax_tpu(x, inv_temperature, interpret):
    rows, n = x.shape
    block_rows = row_block(rows, n * 4 * 2, x.dtype)
    padded_rows = round_up(rows, block_rows)
    spec = pl.BlockSpec((block_rows, n), lambda i: (i, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, inv_temperature=inv_temperature),
        out_shape=jax.ShapeDtypeStruct((padded_rows, n), x.dtype),
        grid=(padded_rows // block_rows,),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(pad_to(x, 0, padded_rows))
    return out[:rows]


def softmax_pallas_tpu(x, temperature: float = 1.0, *, interpret=None):
    """x [rows, n]; the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    return _softmax_tpu(x, inv_temperature=1.0 / float(temperature), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("inv_temperature", "interpret"))
def _softmax_gpu(x, inv_temperature, interpret):
    rows, n = x.shape
    block = pl.next_power_of_2(n)
    if block != n:
        x = jnp.pad(x, ((0, 0), (0, block - n)), constant_values=-jnp.inf)
    spec = pl.BlockSpec((squeezed(), block), lambda i: (i, 0))
    from jax.experimental.pallas import triton as plgpu

    out = pl.pallas_call(
        functools.partial(_kernel, inv_temperature=inv_temperature),
        out_shape=jax.ShapeDtypeStruct((rows, block), x.dtype),
        grid=(rows,),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=plgpu.CompilerParams(num_warps=min(max(block // 256, 1), 16)),
        interpret=interpret,
    )(x)
    return out[:, :n]


def softmax_pallas_gpu(x, temperature: float = 1.0, *, interpret=None):
    """x [rows, n]; the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    return _softmax_gpu(x, inv_temperature=1.0 / float(temperature), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("inv_temperature",))
def _softmax_xla(x, inv_temperature):
    return _softmax_rows(x, inv_temperature).astype(x.dtype)


def softmax_xla(x, temperature: float = 1.0):
    return _softmax_xla(x, inv_temperature=1.0 / float(temperature))
