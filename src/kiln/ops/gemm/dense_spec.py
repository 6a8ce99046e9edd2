"""Dense GEMMs in the checkpoint's [out, in] weight layout.

linear(x, weight, bias=None)
    x:      [..., K]   float32 / float16 / bfloat16
    weight: [N, K]     same dtype as x
    bias:   [N] or None, same dtype
    y = x @ weight^T + bias, shape [..., N], dtype of x; accumulation in float32.

linear_silu_mul(x, weight_gate_up)
    x:              [..., K]
    weight_gate_up: [2N, K]  rows 0..N-1 are the gate projection, N..2N-1 the up projection
    y = silu(x @ Wg^T) * (x @ Wu^T), shape [..., N] (the Llama MLP's first half in one GEMM).
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_last_dim, check_same_dtype, check_tensor
from kiln.ops.gemm.shapes import GEMM_TOLERANCE, fuzz_gemm_shapes, gemm_flops, llm_shapes
from kiln.ops.registry import OpSpec, register_op
from kiln.ops.testing import element_size, randn


def linear_reference(x, weight, bias=None):
    out = x @ weight.T
    return out if bias is None else out + bias


def linear_silu_mul_reference(x, weight_gate_up):
    n = weight_gate_up.shape[0] // 2
    gate, up = x @ weight_gate_up[:n].T, x @ weight_gate_up[n:].T
    return torch.nn.functional.silu(gate) * up


def validate_linear(op: str, x, weight, bias=None) -> None:
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    check_tensor(op, "weight", weight, ndim=2, device=x.device)
    check_last_dim(op, "weight", weight, x.shape[-1], "x's in-features")
    check_same_dtype(op, x=x, weight=weight)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, device=x.device)
        check_last_dim(op, "bias", bias, weight.shape[0], "weight's out-features")
        check_same_dtype(op, x=x, bias=bias)


def _make_linear_inputs(shape, dtype, device, generator):
    M, N, K = shape["M"], shape["N"], shape["K"]
    return {
        "x": randn((M, K), dtype, device, generator),
        "weight": randn((N, K), dtype, device, generator, scale=K**-0.5),
        "bias": randn((N,), dtype, device, generator) if shape.get("bias") else None,
    }


def _make_silu_mul_inputs(shape, dtype, device, generator):
    M, N, K = shape["M"], shape["N"], shape["K"]
    return {
        "x": randn((M, K), dtype, device, generator),
        "weight_gate_up": randn((2 * N, K), dtype, device, generator, scale=K**-0.5),
    }


def _linear_fuzz(rng):
    shapes = fuzz_gemm_shapes(rng)
    return [{**s, "bias": i % 2 == 0} for i, s in enumerate(shapes)]


def _dense_bytes(shape, dtype, weight_rows):
    M, N, K = shape["M"], shape["N"], shape["K"]
    return (M * K + weight_rows * N * K + M * N + (N if shape.get("bias") else 0)) * element_size(dtype)


def _linear_llm_shapes():
    return llm_shapes(bias=False)


def _silu_mul_llm_shapes():
    # gate_up layers only: N is the intermediate size (weight [2N, K]).
    return [
        {"M": m, "N": n, "K": k}
        for k, n in ((4096, 14336), (576, 1536))
        for m in (1, 16, 64, 256, 2048, 8192)
    ]


def _torch_linear(x, weight, bias=None):
    return torch.nn.functional.linear(x, weight, bias)


def _torch_silu_mul(x, weight_gate_up):
    gate, up = (x @ weight_gate_up.T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


LINEAR = register_op(
    OpSpec(
        name="linear",
        description="y = x @ W^T (+ bias), W in [out, in] layout",
        reference=linear_reference,
        make_inputs=_make_linear_inputs,
        fuzz_shapes=_linear_fuzz,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        tolerance=GEMM_TOLERANCE,
        flops=gemm_flops,
        bytes=lambda s, dtype: _dense_bytes(s, dtype, 1),
        bench_shapes={"llm": _linear_llm_shapes()},
        baselines={"torch_matmul": _torch_linear},
        gpu_only_dtypes={"triton": (torch.bfloat16,)},
    )
)

LINEAR_SILU_MUL = register_op(
    OpSpec(
        name="linear_silu_mul",
        description="silu(x @ Wg^T) * (x @ Wu^T) from one [2N, K] gate_up weight",
        reference=linear_silu_mul_reference,
        make_inputs=_make_silu_mul_inputs,
        fuzz_shapes=fuzz_gemm_shapes,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # silu and the product are computed in float32 on the accumulators: same budget as linear.
        tolerance=GEMM_TOLERANCE,
        flops=lambda s, dtype: 4.0 * s["M"] * s["N"] * s["K"] + 5.0 * s["M"] * s["N"],
        bytes=lambda s, dtype: _dense_bytes(s, dtype, 2),
        bench_shapes={"llm": _silu_mul_llm_shapes()},
        baselines={"torch_matmul": _torch_silu_mul},
        gpu_only_dtypes={"triton": (torch.bfloat16,)},
    )
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias): x `[..., K]`, weight `[N, K]`, bias `[N]` -> `[..., N]` in x's dtype."""
    validate_linear("linear", x, weight, bias)
    return LINEAR(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight_gate_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ Wg^T) * (x @ Wu^T): x `[..., K]`, weight_gate_up `[2N, K]` (gate rows first) -> `[..., N]`."""
    validate_linear("linear_silu_mul", x, weight_gate_up)
    if weight_gate_up.shape[0] % 2:
        raise ValueError(
            f"linear_silu_mul: weight_gate_up has {weight_gate_up.shape[0]} rows, expected an even 2N "
            "(gate rows then up rows)"
        )
    return LINEAR_SILU_MUL(x, weight_gate_up)
