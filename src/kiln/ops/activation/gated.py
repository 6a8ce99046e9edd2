"""What the gated activations' specs share: the [gate | up] layout, its validation, shapes and costs.

    x: [..., 2*d] float32 / float16 / bfloat16, gate = x[..., :d], up = x[..., d:]
    y = act(gate) * up: [..., d], x's dtype, math in float32, one rounding of the output.
The kernels are shared too: gated_triton.py (one Triton kernel) and gated_pallas.py (the Pallas and
XLA kernels), each taking the activation as a compile-time constant.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, row_count
from kiln.ops.testing import ONE_ROUNDING_POINTWISE, ONE_ROUNDING_TOLERANCE, element_size, randn

# fp32: sigmoid/exp to a few ulps; halves: one rounding of the output, in norm and per element.
TOLERANCE = ONE_ROUNDING_TOLERANCE
POINTWISE = ONE_ROUNDING_POINTWISE
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCHEMA = "(Tensor x) -> Tensor"


def validate_gated(op: str, x) -> None:
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    if x.shape[-1] % 2:
        raise ValueError(
            f"{op}: x has last dim {x.shape[-1]}, expected an even size 2*d (gate and up halves concatenated)"
        )


def fake_gated(x) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def make_inputs(shape, dtype, device, generator):
    # Scale 2: the gate spans the nonlinear range of silu/gelu (saturation on both sides).
    return {"x": randn((shape["rows"], 2 * shape["d"]), dtype, device, generator, scale=2.0)}


def fuzz_shapes(rng):
    shapes = [{"rows": 1, "d": 1}, {"rows": 1, "d": 1536}, {"rows": 9, "d": 4321}, {"rows": 65, "d": 3}]
    shapes += [{"rows": rng.randint(1, 80), "d": rng.randint(1, 3000)} for _ in range(3)]
    return shapes


def gated_bytes(shape, dtype):
    return 3 * shape["rows"] * shape["d"] * element_size(dtype)  # read 2d, write d per row


def gated_call_case(x):
    """The case of a call on x [..., 2d]."""
    return {"rows": row_count(x), "d": x.shape[-1] // 2}, x.dtype


def llm_shapes():
    shapes = []
    for d in (1536, 14336, 28672 // 8):  # SmolLM2-135M, Llama-3-8B, Llama-3-70B at TP 8
        for rows in (1, 64, 4096):
            shapes.append({"rows": rows, "d": d})
    return shapes
