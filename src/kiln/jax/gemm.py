"""kiln.jax matmul and w8a16_matmul: validate like the torch API, then run the chosen implementation
(pallas_tpu, pallas_gpu or xla)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.jax.checks import FLOAT_DTYPES, check_array, check_last_dim, check_same_dtype
from kiln.ops.pallas_common import resolve


def _check_bias(op, bias, x, n):
    if bias is not None:
        check_array(op, "bias", bias, ndim=1)
        check_last_dim(op, "bias", bias, n, "weight's out-features")
        check_same_dtype(op, x=x, bias=bias)


def matmul(
    x: jax.Array, w: jax.Array, bias: jax.Array | None = None, implementation: str | None = None
) -> jax.Array:
    """`x [..., K] @ w[N, K]^T (+ bias [N])` -> `[..., N]` in x's dtype (f32/f16/bf16); float32
    accumulation."""
    op = "linear"
    check_array(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_array(op, "weight", w, ndim=2)
    check_last_dim(op, "weight", w, x.shape[-1], "x's in-features")
    check_same_dtype(op, x=x, weight=w)
    _check_bias(op, bias, x, w.shape[0])
    from kiln.ops.gemm import pallas

    impl = resolve(op, implementation)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0 or w.shape[0] == 0:
        return jnp.zeros((*x.shape[:-1], w.shape[0]), x.dtype)
    if x2.shape[1] == 0:
        out = jnp.zeros((x2.shape[0], w.shape[0]), x.dtype) + (0 if bias is None else bias)
    else:
        fn = {
            "pallas_tpu": pallas.matmul_pallas_tpu,
            "pallas_gpu": pallas.matmul_pallas_gpu,
            "xla": pallas.matmul_xla,
        }
        out = fn[impl](x2, w, bias)
    return out.reshape(*x.shape[:-1], w.shape[0])


def w8a16_matmul(
    x: jax.Array,
    w_int8: jax.Array,
    scale: jax.Array,
    bias: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """`(x [..., K] @ w_int8[N, K]^T) * scale[N] (+ bias)` -> `[..., N]` in x's dtype: int8 weights
    with per-output-channel float32 scales (scale may also be `[N, 1]`)."""
    op = "w8a16_linear"
    check_array(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES)
    check_array(op, "weight", w_int8, ndim=2, dtypes=(jnp.int8,))
    check_last_dim(op, "weight", w_int8, x.shape[-1], "x's in-features")
    check_array(op, "weight_scale", scale, ndim=(1, 2), dtypes=(jnp.float32,))
    n = w_int8.shape[0]
    if tuple(scale.shape) not in ((n,), (n, 1)):
        raise ValueError(
            f"{op}: weight_scale has shape {tuple(scale.shape)}, "
            f"expected [{n}, 1] or [{n}] (one per output row)"
        )
    _check_bias(op, bias, x, n)
    from kiln.ops.gemm import pallas

    impl = resolve(op, implementation)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0 or n == 0:
        return jnp.zeros((*x.shape[:-1], n), x.dtype)
    fn = {
        "pallas_tpu": pallas.w8a16_pallas_tpu,
        "pallas_gpu": pallas.w8a16_pallas_gpu,
        "xla": pallas.w8a16_xla,
    }
    return fn[impl](x2, w_int8, scale.reshape(n), bias).reshape(*x.shape[:-1], n)
