"""The Pallas and XLA kernels both gated activations run (each op's pallas_tpu.py, pallas_gpu.py and
xla.py binds the activation), on JAX arrays.

    x [..., 2*d] f32/f16/bf16 -> act(x[..., :d]) * x[..., d:]  [..., d], x's dtype, float32 math
    act = "silu" (a * sigmoid(a)) or "gelu_tanh" (tanh-approximated GELU)

TPU (Mosaic): when d is a multiple of 128 the gate and up halves are two BlockSpecs over x itself
(column blocks 0 and 1), so nothing is copied; otherwise the wrapper splits and pads the halves to
128 lanes; a program owns `block_rows` rows. GPU (Pallas Triton): one program per row, halves padded
to a power of two. XLA: the same math in jax.numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import (
    LANES,
    gpu_interpret,
    pad_to,
    round_up,
    row_block,
    squeezed,
    tpu_interpret,
    tpu_params,
)


def act_mul(gate, up, activation: str):
    g = gate.astype(jnp.float32)
    if activation == "silu":
        a = g * jax.nn.sigmoid(g)
    else:
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): same function, but without the cancellation of
        # 1 + tanh(z) for z << 0, which loses all relative precision once tanh(z) rounds to -1.
        a = g * jax.nn.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    return a * up.astype(jnp.float32)


def _kernel(gate_ref, up_ref, y_ref, *, activation: str):
    y_ref[...] = act_mul(gate_ref[...], up_ref[...], activation).astype(y_ref.dtype)


def _over_rows(kernel, x):
    """Run a [rows, 2*d] -> [rows, d] kernel on x [..., 2*d] (no launch when there is nothing to do)."""
    d = x.shape[-1] // 2
    if x.size == 0:
        return jnp.zeros((*x.shape[:-1], d), x.dtype)
    return kernel(x.reshape(-1, 2 * d)).reshape(*x.shape[:-1], d)


@functools.partial(jax.jit, static_argnames=("activation", "interpret"))
def _gated_tpu(x, activation, interpret):
    rows, d = x.shape[0], x.shape[1] // 2
    if d % LANES == 0:
        width, gate_up = d, (x, x)
        gate_index, up_index = (lambda i: (i, 0)), (lambda i: (i, 1))
    else:
        width = round_up(d, LANES)
        gate_up = (pad_to(x[:, :d], 1, width), pad_to(x[:, d:], 1, width))
        gate_index = up_index = lambda i: (i, 0)
    block_rows = row_block(rows, width * 4 * 3, x.dtype)
    padded_rows = round_up(rows, block_rows)
    out = pl.pallas_call(
        functools.partial(_kernel, activation=activation),
        out_shape=jax.ShapeDtypeStruct((padded_rows, width), x.dtype),
        grid=(padded_rows // block_rows,),
        in_specs=[pl.BlockSpec((block_rows, width), gate_index), pl.BlockSpec((block_rows, width), up_index)],
        out_specs=pl.BlockSpec((block_rows, width), lambda i: (i, 0)),
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(*(pad_to(a, 0, padded_rows) for a in gate_up))
    return out[:rows, :d]


def gated_pallas_tpu(x, activation: str, *, interpret=None):
    """x [..., 2*d]; the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    return _over_rows(lambda x2: _gated_tpu(x2, activation=activation, interpret=interpret), x)


@functools.partial(jax.jit, static_argnames=("activation", "interpret"))
def _gated_gpu(x, activation, interpret):
    rows, d = x.shape[0], x.shape[1] // 2
    block = pl.next_power_of_2(d)
    gate, up = pad_to(x[:, :d], 1, block), pad_to(x[:, d:], 1, block)
    spec = pl.BlockSpec((squeezed(), block), lambda i: (i, 0))
    from jax.experimental.pallas import triton as plgpu

    out = pl.pallas_call(
        functools.partial(_kernel, activation=activation),
        out_shape=jax.ShapeDtypeStruct((rows, block), x.dtype),
        grid=(rows,),
        in_specs=[spec, spec],
        out_specs=spec,
        compiler_params=plgpu.CompilerParams(num_warps=min(max(block // 256, 1), 8)),
        interpret=interpret,
    )(gate, up)
    return out[:, :d]


def gated_pallas_gpu(x, activation: str, *, interpret=None):
    """x [..., 2*d]; the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    return _over_rows(lambda x2: _gated_gpu(x2, activation=activation, interpret=interpret), x)


@functools.partial(jax.jit, static_argnames=("activation",))
def _gated_xla(x, activation):
    d = x.shape[-1] // 2
    return act_mul(x[..., :d], x[..., d:], activation).astype(x.dtype)


def gated_xla(x, activation: str):
    """x [..., 2*d]; jitted jax.numpy."""
    return _over_rows(lambda x2: _gated_xla(x2, activation=activation), x)
