"""gelu_tanh_and_mul: the gated tanh-GELU of an MLP's fused gate/up projection (Gemma).

    x: [..., 2*d]  float32 / float16 / bfloat16 (gate and up halves concatenated)
    y = gelu_tanh(x[..., :d]) * x[..., d:],
    gelu_tanh(a) = 0.5 * a * (1 + tanh(sqrt(2/pi) * (a + 0.044715 a^3)))
    Returns y [..., d] in x's dtype; math in float32, one rounding of the output.
"""

from __future__ import annotations

import torch

from kiln.ops.activation.gated import (
    DTYPES,
    POINTWISE,
    SCHEMA,
    TOLERANCE,
    fake_gated,
    fuzz_shapes,
    gated_bytes,
    gated_call_case,
    llm_shapes,
    make_inputs,
    validate_gated,
)
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import compute_dtype


def gelu_tanh_and_mul_reference(x):
    """In float64 (compute_dtype), with 0.5 (1 + tanh(z)) as sigmoid(2 z): the same function, but
    F.gelu(approximate="tanh") forms 1 + tanh(z), which cancels for z << 0 even in float64 (1.5e-4
    relative at a gate of -6.5, against 1e-15 this way, both checked with 50-digit mpmath)."""
    xf = x.to(compute_dtype(x.dtype))
    d = x.shape[-1] // 2
    gate, up = xf[..., :d], xf[..., d:]
    z2 = 2 * (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    return (gate * torch.sigmoid(z2) * up).to(x.dtype)


def validate_gelu_tanh_and_mul(x) -> None:
    validate_gated("gelu_tanh_and_mul", x)


def _torch_eager(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :d], approximate="tanh") * x[..., d:]


GELU_TANH_AND_MUL = OpSpec(
    name="gelu_tanh_and_mul",
    description="gelu_tanh(gate) * up over x = [gate | up] on the last dim",
    reference=gelu_tanh_and_mul_reference,
    make_inputs=make_inputs,
    fuzz_shapes=fuzz_shapes,
    dtypes=DTYPES,
    tolerance=TOLERANCE,
    pointwise=POINTWISE,
    flops=lambda s, dtype: 9 * s["rows"] * s["d"],
    bytes=gated_bytes,
    bench_shapes={"llm": llm_shapes()},
    baselines={"torch_eager": _torch_eager},
    schema=SCHEMA,
    validate=validate_gelu_tanh_and_mul,
    fake=fake_gated,
    call_case=gated_call_case,
    doc=__doc__,
)

gelu_tanh_and_mul = define_op(GELU_TANH_AND_MUL, "kiln.ops")
