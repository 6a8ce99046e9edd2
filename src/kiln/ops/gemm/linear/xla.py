"""linear in plain jax.lax (XLA), and what every JAX backend of the dense-layout GEMMs (linear,
linear_silu_mul, w8a16_linear) shares: the [..., K] -> [M, K] row view and the empty cases.

    x [..., K] f32/f16/bf16 @ w[rows, K]^T -> [..., N] in x's dtype, float32 accumulation; fp32
    operands at HIGHEST precision (IEEE fp32, no TF32 / bf16 passes), to meet the fp32 tolerance.
Epilogues on the float32 accumulator, in this order: `scale` [N] (w8a16_linear's per-channel
scale; w is widened to x's dtype first, exact for int8), `bias` [N], and `silu_mul` (w is [2N, K],
gate rows then up rows: the output is silu(gate) * up).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kiln.ops.gemm.linear.spec import LINEAR


def over_rows(kernel, x, n: int, bias):
    """Run `kernel(x2 [M, K]) -> [M, n]` on x [..., K]: no launch when M, n or K is zero (K = 0
    gives the bias, or zeros)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(math.prod(lead), k)  # not (-1, k): jax cannot infer -1 when k is 0
    if x2.shape[0] == 0 or n == 0:
        return jnp.zeros((*lead, n), x.dtype)
    if k == 0:
        out = jnp.zeros((x2.shape[0], n), x.dtype) + (0 if bias is None else bias)
    else:
        out = kernel(x2)
    return out.reshape(*lead, n)


def dot_weight_rows(x, w, precision):
    """x [m, k] @ w [n, k]^T in float32: the contraction of both last dims, no transposed copy."""
    contract_last = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(
        x, w.astype(x.dtype), contract_last, preferred_element_type=jnp.float32, precision=precision
    )


def gemm_precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


@functools.partial(jax.jit, static_argnames=("silu_mul",))
def gemm_xla(x, w, scale=None, bias=None, silu_mul: bool = False):
    """x [M, K] @ w^T with the epilogues of the module docstring -> [M, N] in x's dtype."""
    out = dot_weight_rows(x, w, gemm_precision(x.dtype))
    if scale is not None:
        out = out * scale.astype(jnp.float32).reshape(1, -1)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    if silu_mul:
        gate, up = jnp.split(out, 2, axis=-1)
        out = gate * jax.nn.sigmoid(gate) * up
    return out.astype(x.dtype)


def linear_xla(x, weight, bias=None):
    return over_rows(lambda x2: gemm_xla(x2, weight, None, bias), x, weight.shape[0], bias)


LINEAR.register_jax("xla", linear_xla)
