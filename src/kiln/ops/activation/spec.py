"""Gated activations of an MLP's fused gate/up projection.

silu_and_mul(x)       x: [..., 2*d] float32 / float16 / bfloat16 -> [..., d], same dtype
    y = silu(x[..., :d]) * x[..., d:],  silu(a) = a * sigmoid(a)          (Llama, Mistral, Qwen)
gelu_tanh_and_mul(x)  x: [..., 2*d] -> [..., d]
    y = gelu_tanh(x[..., :d]) * x[..., d:],
    gelu_tanh(a) = 0.5 * a * (1 + tanh(sqrt(2/pi) * (a + 0.044715 a^3)))   (Gemma)
Math in float32, one rounding of the output.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor
from kiln.ops.registry import OpSpec, register_op
from kiln.ops.testing import compute_dtype, element_size, randn


def silu_and_mul_reference(x):
    xf = x.to(compute_dtype(x.dtype))
    d = x.shape[-1] // 2
    return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def gelu_tanh_and_mul_reference(x):
    xf = x.to(compute_dtype(x.dtype))
    d = x.shape[-1] // 2
    return (torch.nn.functional.gelu(xf[..., :d], approximate="tanh") * xf[..., d:]).to(x.dtype)


def validate_gated(op: str, x) -> None:
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    if x.shape[-1] % 2:
        raise ValueError(
            f"{op}: x has last dim {x.shape[-1]}, expected an even size 2*d (gate and up halves concatenated)"
        )


def _make_inputs(shape, dtype, device, generator):
    # Scale 2: the gate spans the nonlinear range of silu/gelu (saturation on both sides).
    return {"x": randn((shape["rows"], 2 * shape["d"]), dtype, device, generator, scale=2.0)}


def _fuzz_shapes(rng):
    shapes = [{"rows": 1, "d": 1}, {"rows": 1, "d": 1536}, {"rows": 9, "d": 4321}, {"rows": 65, "d": 3}]
    shapes += [{"rows": rng.randint(1, 80), "d": rng.randint(1, 3000)} for _ in range(3)]
    return shapes


def _bytes(shape, dtype):
    return 3 * shape["rows"] * shape["d"] * element_size(dtype)  # read 2d, write d per row


def _llm_shapes():
    shapes = []
    for d in (1536, 14336, 28672 // 8):  # SmolLM2-135M, Llama-3-8B, Llama-3-70B at TP 8
        for rows in (1, 64, 4096):
            shapes.append({"rows": rows, "d": d})
    return shapes


def _silu_eager(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def _gelu_eager(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


# fp32: sigmoid/exp to a few ulps; halves: one rounding of the output (2^-11, 2^-8) in norm.
_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

SILU_AND_MUL = register_op(
    OpSpec(
        name="silu_and_mul",
        description="silu(gate) * up over x = [gate | up] on the last dim",
        reference=silu_and_mul_reference,
        make_inputs=_make_inputs,
        fuzz_shapes=_fuzz_shapes,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        tolerance=_TOLERANCE,
        flops=lambda s, dtype: 5 * s["rows"] * s["d"],  # exp, add, divide, two multiplies
        bytes=_bytes,
        bench_shapes={"llm": _llm_shapes()},
        baselines={"torch_eager": _silu_eager},
    )
)

GELU_TANH_AND_MUL = register_op(
    OpSpec(
        name="gelu_tanh_and_mul",
        description="gelu_tanh(gate) * up over x = [gate | up] on the last dim",
        reference=gelu_tanh_and_mul_reference,
        make_inputs=_make_inputs,
        fuzz_shapes=_fuzz_shapes,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        tolerance=_TOLERANCE,
        flops=lambda s, dtype: 9 * s["rows"] * s["d"],
        bytes=_bytes,
        bench_shapes={"llm": _llm_shapes()},
        baselines={"torch_eager": _gelu_eager},
    )
)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x `[..., 2*d]`; returns `[..., d]` in x's dtype."""
    validate_gated("silu_and_mul", x)
    return SILU_AND_MUL(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[..., :d]) * x[..., d:] for x `[..., 2*d]`; returns `[..., d]` in x's dtype."""
    validate_gated("gelu_tanh_and_mul", x)
    return GELU_TANH_AND_MUL(x)
