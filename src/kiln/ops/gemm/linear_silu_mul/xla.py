"""linear_silu_mul in plain jax.lax (XLA): one [M, 2N] product in float32, silu(gate) * up on it,
one rounding to x's dtype (../linear/xla.py)."""

from __future__ import annotations

from kiln.ops.gemm.linear.xla import gemm_xla, over_rows
from kiln.ops.gemm.linear_silu_mul.spec import LINEAR_SILU_MUL


def linear_silu_mul_xla(x, weight_gate_up):
    n = weight_gate_up.shape[0] // 2
    return over_rows(lambda x2: gemm_xla(x2, weight_gate_up, None, None, silu_mul=True), x, n, None)


LINEAR_SILU_MUL.register_jax("xla", linear_silu_mul_xla)
