"""softmax in plain jax.numpy (XLA fuses it), and what the Pallas kernels share.

    x [..., n] f32/f16/bf16 -> softmax(x / temperature) [..., n], x's dtype, float32 math
    (subtract the row max before exp, so no overflow for any finite input).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.softmax.softmax.spec import SOFTMAX


def softmax_rows(x, inv_temperature: float):
    """float32 softmax of x * inv_temperature over the last dim."""
    z = x.astype(jnp.float32) * inv_temperature
    e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def row_kernel(x_ref, y_ref, *, inv_temperature: float):
    """The Pallas kernel body of both backends: the rows of one block, in float32."""
    y_ref[...] = softmax_rows(x_ref[...], inv_temperature).astype(y_ref.dtype)


def over_rows(kernel, x, temperature):
    """Run a [rows, n] kernel(x2, inv_temperature) on x [..., n] (no launch for zero rows)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x
    return kernel(x2, 1.0 / float(temperature)).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("inv_temperature",))
def _softmax_xla(x, inv_temperature):
    return softmax_rows(x, inv_temperature).astype(x.dtype)


def softmax_xla(x, temperature: float = 1.0):
    return over_rows(lambda x2, inv_t: _softmax_xla(x2, inv_temperature=inv_t), x, temperature)


SOFTMAX.register_jax("xla", softmax_xla)
