"""silu_and_mul: the gated SiLU of an MLP's fused gate/up projection (Llama, Mistral, Qwen).

    x: [..., 2*d]  float32 / float16 / bfloat16 (gate and up halves concatenated)
    y = silu(x[..., :d]) * x[..., d:],  silu(a) = a * sigmoid(a)
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


def silu_and_mul_reference(x):
    xf = x.to(compute_dtype(x.dtype))
    d = x.shape[-1] // 2
    return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def validate_silu_and_mul(x) -> None:
    validate_gated("silu_and_mul", x)


def _torch_eager(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


SILU_AND_MUL = OpSpec(
    name="silu_and_mul",
    description="silu(gate) * up over x = [gate | up] on the last dim",
    reference=silu_and_mul_reference,
    make_inputs=make_inputs,
    fuzz_shapes=fuzz_shapes,
    dtypes=DTYPES,
    tolerance=TOLERANCE,
    pointwise=POINTWISE,
    flops=lambda s, dtype: 5 * s["rows"] * s["d"],  # exp, add, divide, two multiplies
    bytes=gated_bytes,
    bench_shapes={"llm": llm_shapes()},
    baselines={"torch_eager": _torch_eager},
    schema=SCHEMA,
    validate=validate_silu_and_mul,
    fake=fake_gated,
    call_case=gated_call_case,
    doc=__doc__,
)

silu_and_mul = define_op(SILU_AND_MUL, "kiln.ops")
