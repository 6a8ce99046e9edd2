"""linear_silu_mul: the Llama MLP's first half (gate and up projections, SiLU-and-mul) in one GEMM.

x:              [..., K]  float32 / float16 / bfloat16
weight_gate_up: [2N, K]   same dtype as x; rows 0..N-1 are the gate projection, N..2N-1 the up
y = silu(x @ Wg^T) * (x @ Wu^T), shape [..., N], dtype of x; accumulation, silu and the product
in float32 (the [..., 2N] intermediate is never rounded to x's dtype).
"""

from __future__ import annotations

import torch

from kiln.ops.checks import row_count
from kiln.ops.gemm.linear.spec import check_dense_operands
from kiln.ops.gemm.shapes import GEMM_TOLERANCE, QUANT_M, dense_gemm_bytes, fuzz_gemm_shapes
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import randn


def linear_silu_mul_reference(x, weight_gate_up):
    n = weight_gate_up.shape[0] // 2
    gate, up = x @ weight_gate_up[:n].T, x @ weight_gate_up[n:].T
    return torch.nn.functional.silu(gate) * up


def validate_linear_silu_mul(x, weight_gate_up) -> None:
    check_dense_operands("linear_silu_mul", x, weight_gate_up)
    if weight_gate_up.shape[0] % 2:
        raise ValueError(
            f"linear_silu_mul: weight_gate_up has {weight_gate_up.shape[0]} rows, expected an even 2N "
            "(gate rows then up rows)"
        )


def _make_inputs(shape, dtype, device, generator):
    M, N, K = shape["M"], shape["N"], shape["K"]
    return {
        "x": randn((M, K), dtype, device, generator),
        "weight_gate_up": randn((2 * N, K), dtype, device, generator, scale=K**-0.5),
    }


def _llm_shapes():
    # gate_up layers only: N is the intermediate size (weight [2N, K]).
    return [
        {"M": m, "N": n, "K": k}
        for k, n in ((4096, 14336), (576, 1536))
        for m in (1, 16, 64, 256, 2048, 8192)
    ]


def _torch_silu_mul(x, weight_gate_up):
    gate, up = (x @ weight_gate_up.T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


LINEAR_SILU_MUL = OpSpec(
    name="linear_silu_mul",
    description="silu(x @ Wg^T) * (x @ Wu^T) from one [2N, K] gate_up weight",
    reference=linear_silu_mul_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=fuzz_gemm_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # silu and the product are computed in float32 on the accumulators: same budget as linear.
    tolerance=GEMM_TOLERANCE,
    flops=lambda s, dtype: 4.0 * s["M"] * s["N"] * s["K"] + 5.0 * s["M"] * s["N"],
    bytes=lambda s, dtype: dense_gemm_bytes(s, dtype, 2),
    bench_shapes={"llm": _llm_shapes(), "quant": [{"M": m, "N": 14336, "K": 4096} for m in QUANT_M]},
    baselines={"torch_matmul": _torch_silu_mul},
    gpu_only_dtypes={"triton": (torch.bfloat16,)},
    schema="(Tensor x, Tensor weight_gate_up) -> Tensor",
    validate=validate_linear_silu_mul,
    fake=lambda x, weight_gate_up: x.new_empty((*x.shape[:-1], weight_gate_up.shape[0] // 2)),
    call_case=lambda x, weight_gate_up: (
        {"M": row_count(x), "N": weight_gate_up.shape[0] // 2, "K": x.shape[-1]},
        x.dtype,
    ),
    doc=__doc__,
)

linear_silu_mul = define_op(LINEAR_SILU_MUL, "kiln.ops")
