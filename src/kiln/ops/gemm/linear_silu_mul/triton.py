"""Triton linear_silu_mul: the dense GEMM kernel of ../linear/triton.py with SILU_MUL=True (the
program loads the gate and the up weight tiles of the same output columns and writes
silu(gate) * up), on the TMA kernel of ../linear/triton_tma.py on Hopper. Registered as "triton"
(the automatic TMA / pointer dispatch) and "triton_tma" (the TMA kernel wherever it can run)."""

from __future__ import annotations

import torch

from kiln.ops.gemm.linear.triton import launch_dense
from kiln.ops.gemm.linear.triton_tma import tma_device
from kiln.ops.gemm.linear_silu_mul.spec import LINEAR_SILU_MUL
from kiln.ops.gemm.tiling import config_space
from kiln.ops.registry import Implementation, triton_available


def linear_silu_mul_triton(x, weight_gate_up, config: dict | None = None):
    """`linear_silu_mul`: x `[..., K]`, weight_gate_up `[2N, K]` -> `[..., N]`; TMA kernel on Hopper."""
    return launch_dense("linear_silu_mul", x, weight_gate_up, None, True, config)


def linear_silu_mul_tma_triton(x, weight_gate_up, config: dict | None = None):
    """`linear_silu_mul` through the TMA kernel whenever the operands are TMA-eligible."""
    return launch_dense("linear_silu_mul", x, weight_gate_up, None, True, config, kernel="tma")


def linear_silu_mul_pointer_triton(x, weight_gate_up, config: dict | None = None):
    """`linear_silu_mul` through the pointer kernel only."""
    return launch_dense("linear_silu_mul", x, weight_gate_up, None, True, config, kernel="pointer")


def _silu_mul_configs(shape, dtype):
    return config_space(shape, dtype, b_tiles=2)  # gate and up weight tiles per K step


LINEAR_SILU_MUL.register(
    Implementation(
        "triton",
        linear_silu_mul_triton,
        triton_available,
        configs=_silu_mul_configs,
        description="gate and up tiles in one program, SiLU-and-mul epilogue",
    )
)
LINEAR_SILU_MUL.register(
    Implementation(
        "triton_tma",
        linear_silu_mul_tma_triton,
        tma_device,
        configs=_silu_mul_configs,
        description="TMA descriptor loads (Hopper+), gate and up tiles, SiLU-and-mul epilogue",
    )
)
# bf16 tl.dot is wrong in the Triton interpreter, for this kernel as for the pointer one.
LINEAR_SILU_MUL.gpu_only_dtypes.setdefault("triton_tma", (torch.bfloat16,))
# On Hopper "triton" runs the TMA kernel: the pointer kernel alone is timed beside it and cuBLAS.
LINEAR_SILU_MUL.baselines.setdefault("triton_pointer", linear_silu_mul_pointer_triton)
