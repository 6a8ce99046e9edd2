"""layer_norm in plain jax.numpy (XLA fuses it), and what the Pallas kernels share.

    x [..., hidden] f32/f16/bf16, weight and bias [hidden]
    y = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias, biased variance, statistics in float32.
The variance is taken around the mean (never E[x^2] - E[x]^2, which cancels for rows with a large
mean). A kernel whose block is wider than the row (zero-padded columns) masks the padding out of
the variance and divides by the true hidden size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.norm.layer_norm.spec import LAYER_NORM


def _normalize(x, w, b, eps: float, hidden: int):
    """x [..., width] float32 with width >= hidden (columns past hidden are zero padding); w, b float32."""
    mean = jnp.sum(x, axis=-1, keepdims=True) / hidden
    centered = x - mean
    if x.shape[-1] != hidden:  # padding columns must not add (0 - mean)^2
        cols = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        centered = jnp.where(cols < hidden, centered, 0.0)
    inv_std = jax.lax.rsqrt(jnp.sum(centered * centered, axis=-1, keepdims=True) / hidden + eps)
    y = centered * inv_std * w
    return y if b is None else y + b


def rows_kernel(*refs, eps: float, hidden: int, has_bias: bool):
    """The Pallas kernel body both Pallas backends run on their blocks of rows: refs are
    (x, weight, [bias,] y)."""
    if has_bias:
        x_ref, w_ref, b_ref, y_ref = refs
        b = b_ref[...].astype(jnp.float32)
    else:
        x_ref, w_ref, y_ref = refs
        b = None
    x = x_ref[...].astype(jnp.float32)
    y_ref[...] = _normalize(x, w_ref[...].astype(jnp.float32), b, eps, hidden).astype(y_ref.dtype)


def over_rows(kernel, x, weight, bias, eps):
    """Run a [rows, hidden] kernel `kernel(x2, weight, bias, eps)` on [..., hidden] arrays (no launch
    for zero rows)."""
    shape, hidden = x.shape, x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.shape[0] == 0:
        return x
    return kernel(x2, weight, bias, float(eps)).reshape(shape)


@functools.partial(jax.jit, static_argnames=("eps",))
def _layer_norm_xla(x, weight, bias, eps):
    b = None if bias is None else bias.astype(jnp.float32)
    y = _normalize(x.astype(jnp.float32), weight.astype(jnp.float32), b, eps, x.shape[-1])
    return y.astype(x.dtype)


def layer_norm_xla(x, weight, bias=None, eps: float = 1e-5):
    """x [..., hidden], weight/bias [hidden] -> y like x."""
    return over_rows(lambda x2, w, b, e: _layer_norm_xla(x2, w, b, eps=e), x, weight, bias, eps)


LAYER_NORM.register_jax("xla", layer_norm_xla)
