"""linear_silu_mul as linear's Mosaic TPU kernel (../linear/pallas_tpu.py) with the SiLU-and-mul
epilogue: gate and up tiles of the same output columns, two VMEM accumulators, one output write."""

from __future__ import annotations

from kiln.ops.gemm.linear.pallas_tpu import gemm_tpu
from kiln.ops.gemm.linear.xla import over_rows
from kiln.ops.gemm.linear_silu_mul.spec import LINEAR_SILU_MUL
from kiln.ops.pallas_common import tpu_interpret


def linear_silu_mul_pallas_tpu(x, weight_gate_up, *, blocks=None, interpret=None):
    """x [..., K], weight_gate_up [2N, K] -> silu(x Wg^T) * (x Wu^T) [..., N] (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    n = weight_gate_up.shape[0] // 2

    def kernel(x2):
        return gemm_tpu(x2, weight_gate_up, None, None, silu_mul=True, blocks=blocks, interpret=interpret)

    return over_rows(kernel, x, n, None)


LINEAR_SILU_MUL.register_jax("pallas_tpu", linear_silu_mul_pallas_tpu)
