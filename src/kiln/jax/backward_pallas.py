"""Pallas Mosaic TPU backward kernels for kiln.jax's custom_vjp ops (kiln.jax.autodiff); off a TPU
they run in the TPU interpreter (uninitialized memory reads as NaN, so an unwritten gradient fails).

rms_norm, y = x * r * (w + offset), r = rsqrt(mean(x^2) + eps), g = dL/dy, all in float32:
    dx = r * (g (w + offset) - x r^2 mean(g (w + offset) x))           [rows, H], x's dtype
    dw = sum over rows of g x r: each program writes its rows' terms, summed after in float32
         (a fixed order, no atomics), then cast to w's dtype.
gated, y = act(a) * b for x = [a | b]:
    da = g b act'(a),  db = g act(a)                                     [rows, d] each, x's dtype
    silu: act' = s (1 + a (1 - s)), s = sigmoid(a)
    gelu_tanh: act = a s, s = sigmoid(2z), z = k (a + c a^3); act' = s + a s (1 - s) 2k (1 + 3c a^2)
A program owns `block_rows` full rows (rows padded to a multiple; padded rows have g = 0 and
contribute nothing); the gated halves are split and padded to 128 lanes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import LANES, pad_to, round_up, row_block, tpu_interpret, tpu_params

GELU_K = 0.7978845608028654  # sqrt(2 / pi)
GELU_C = 0.044715


def _rms_norm_backward_kernel(x_ref, w_ref, g_ref, dx_ref, dw_rows_ref, *, eps, offset):
    x = x_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    gw = g * (w_ref[...].astype(jnp.float32) + offset)
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    dx = r * (gw - x * r * r * jnp.mean(gw * x, axis=-1, keepdims=True))
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_rows_ref[...] = g * x * r


@functools.partial(jax.jit, static_argnames=("eps", "offset", "interpret"))
def _rms_norm_backward(x, weight, grad_y, eps, offset, interpret):
    rows, hidden = x.shape
    block_rows = row_block(rows, hidden * 4 * 4, jnp.float32)
    padded = round_up(rows, block_rows)
    row_spec = pl.BlockSpec((block_rows, hidden), lambda i: (i, 0))
    dx, dw_rows = pl.pallas_call(
        functools.partial(_rms_norm_backward_kernel, eps=eps, offset=offset),
        out_shape=(
            jax.ShapeDtypeStruct((padded, hidden), x.dtype),
            jax.ShapeDtypeStruct((padded, hidden), jnp.float32),
        ),
        grid=(padded // block_rows,),
        in_specs=[row_spec, pl.BlockSpec((1, hidden), lambda i: (0, 0)), row_spec],
        out_specs=(row_spec, row_spec),
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(pad_to(x, 0, padded), weight.reshape(1, hidden), pad_to(grad_y, 0, padded))
    return dx[:rows], dw_rows.sum(axis=0).astype(weight.dtype)


def rms_norm_backward_pallas(x, weight, grad_y, eps: float, weight_offset: float = 0.0, *, interpret=None):
    """(dx [..., H] x's dtype, dw [H] weight's dtype) of y = rms_norm(x, weight, eps, weight_offset)."""
    interpret = tpu_interpret() if interpret is None else interpret
    hidden = x.shape[-1]
    if x.size == 0:
        return jnp.zeros_like(x), jnp.zeros_like(weight)
    dx, dw = _rms_norm_backward(
        x.reshape(-1, hidden), weight, grad_y.reshape(-1, hidden), eps=float(eps),
        offset=float(weight_offset), interpret=interpret,
    )  # fmt: skip
    return dx.reshape(x.shape), dw


def _gated_backward_kernel(a_ref, b_ref, g_ref, da_ref, db_ref, *, activation):
    a = a_ref[...].astype(jnp.float32)
    b = b_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    if activation == "silu":
        s = jax.nn.sigmoid(a)
        act, act_grad = a * s, s * (1 + a * (1 - s))
    else:  # 0.5 (1 + tanh(z)) = sigmoid(2z): no cancellation for z << 0
        s = jax.nn.sigmoid(2 * GELU_K * (a + GELU_C * a * a * a))
        act = a * s
        act_grad = s + a * s * (1 - s) * 2 * GELU_K * (1 + 3 * GELU_C * a * a)
    da_ref[...] = (g * b * act_grad).astype(da_ref.dtype)
    db_ref[...] = (g * act).astype(db_ref.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "interpret"))
def _gated_backward(x, grad_y, activation, interpret):
    rows, d = grad_y.shape
    width = round_up(d, LANES)
    block_rows = row_block(rows, width * 4 * 5, jnp.float32)
    padded = round_up(rows, block_rows)
    operands = [pad_to(pad_to(t, 1, width), 0, padded) for t in (x[:, :d], x[:, d:], grad_y)]
    spec = pl.BlockSpec((block_rows, width), lambda i: (i, 0))
    out = jax.ShapeDtypeStruct((padded, width), x.dtype)
    da, db = pl.pallas_call(
        functools.partial(_gated_backward_kernel, activation=activation),
        out_shape=(out, out),
        grid=(padded // block_rows,),
        in_specs=[spec, spec, spec],
        out_specs=(spec, spec),
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(*operands)
    return jnp.concatenate([da[:rows, :d], db[:rows, :d]], axis=-1)


def gated_backward_pallas(x, grad_y, activation: str, *, interpret=None):
    """dx [..., 2d] (x's dtype) of y = act(x[..., :d]) * x[..., d:]; activation "silu" | "gelu_tanh"."""
    interpret = tpu_interpret() if interpret is None else interpret
    if x.size == 0:
        return jnp.zeros_like(x)
    d = x.shape[-1] // 2
    dx = _gated_backward(
        x.reshape(-1, 2 * d), grad_y.reshape(-1, d), activation=activation, interpret=interpret
    )
    return dx.reshape(x.shape)
