"""rms_norm in plain jax.numpy (XLA fuses it into one pass), and what the Pallas kernels share.

    x, residual [..., hidden] f32/f16/bf16, weight [hidden]
    s = x + residual (the new residual stream), y = s * rsqrt(mean(s^2) + eps) * (offset + weight)
Statistics in float32; a nonzero weight_offset is added to a float32 copy of the weight. The mean
divides by the true hidden size, so zero padding never changes it.
Each backend returns y, or (y, s) with a residual (the op's output, then the in-place argument).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.norm.rms_norm.spec import RMS_NORM


def _normalize(s, w, eps: float, hidden: int):
    """s, w float32; the padded columns of s are zero, so dividing by the true `hidden` is exact."""
    inv_rms = jax.lax.rsqrt(jnp.sum(s * s, axis=-1, keepdims=True) / hidden + eps)
    return s * inv_rms * w


def rows_kernel(*refs, eps: float, hidden: int, has_residual: bool):
    """The Pallas kernel body both Pallas backends run on their blocks of rows: refs are
    (x, [residual,] weight, y[, new residual])."""
    if has_residual:
        x_ref, r_ref, w_ref, y_ref, s_ref = refs
        s = x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)
        s_ref[...] = s.astype(s_ref.dtype)
    else:
        x_ref, w_ref, y_ref = refs
        s = x_ref[...].astype(jnp.float32)
    y_ref[...] = _normalize(s, w_ref[...].astype(jnp.float32), eps, hidden).astype(y_ref.dtype)


def over_rows(kernel, x, weight, eps, residual, weight_offset=0.0):
    """Run a [rows, hidden] kernel on [..., hidden] arrays (no launch for zero rows); the kernel
    sees the weight with `weight_offset` already added (in float32)."""
    if weight_offset != 0.0:
        weight = weight.astype(jnp.float32) + weight_offset
    shape, hidden = x.shape, x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.shape[0] == 0:
        return x if residual is None else (x, residual)
    out = kernel(x2, weight, float(eps), None if residual is None else residual.reshape(-1, hidden))
    if residual is None:
        return out.reshape(shape)
    return out[0].reshape(shape), out[1].reshape(shape)


@functools.partial(jax.jit, static_argnames=("eps",))
def _rms_norm_xla(x, weight, residual, eps):
    s = x.astype(jnp.float32)
    if residual is not None:
        s = s + residual.astype(jnp.float32)
    y = _normalize(s, weight.astype(jnp.float32), eps, x.shape[-1]).astype(x.dtype)
    return y if residual is None else (y, s.astype(x.dtype))


def rms_norm_xla(x, weight, eps: float = 1e-6, residual=None, weight_offset: float = 0.0):
    return over_rows(
        lambda x2, w, e, r: _rms_norm_xla(x2, w, r, eps=e), x, weight, eps, residual, weight_offset
    )


RMS_NORM.register_jax("xla", rms_norm_xla)
