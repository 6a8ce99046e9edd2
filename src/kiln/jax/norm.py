"""kiln.jax.rms_norm: validates like the torch API, then runs the chosen implementation."""

from __future__ import annotations

import jax

from kiln.jax.checks import FLOAT_DTYPES, check_array, check_last_dim, check_same_dtype, check_shape
from kiln.jax.dispatch import resolve


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float = 1e-6,
    residual: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMSNorm over the last dim of x `[..., hidden]` (f32/f16/bf16) with `weight` `[hidden]`.

    With `residual` (x's shape and dtype) returns `(y, x + residual)`, the second being the new
    residual stream (JAX arrays are immutable, so it is returned rather than written in place).
    """
    op = "rms_norm"
    check_array(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_array(op, "weight", weight, ndim=1)
    check_last_dim(op, "weight", weight, x.shape[-1], "x's hidden size")
    check_same_dtype(op, x=x, weight=weight)
    if residual is not None:
        check_array(op, "residual", residual)
        check_shape(op, "residual", residual, x.shape, "x's shape")
        check_same_dtype(op, x=x, residual=residual)
    if not eps > 0:
        raise ValueError(f"rms_norm: eps must be positive, got {eps}")
    from kiln.ops.norm import pallas

    impl = resolve(op, implementation)
    fn = {
        "pallas_tpu": pallas.rms_norm_pallas_tpu,
        "pallas_gpu": pallas.rms_norm_pallas_gpu,
        "xla": pallas.rms_norm_xla,
    }[impl]
    shape, hidden = x.shape, x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.shape[0] == 0:
        return x if residual is None else (x, residual)
    out = fn(x2, weight, eps, None if residual is None else residual.reshape(-1, hidden))
    if residual is None:
        return out.reshape(shape)
    return out[0].reshape(shape), out[1].reshape(shape)
