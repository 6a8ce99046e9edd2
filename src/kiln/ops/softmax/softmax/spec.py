"""softmax: softmax(x / temperature) over the last dim (the sampler's logits -> probabilities step).

    x:           [..., N]  float32 / float16 / bfloat16 (N up to a vocabulary: 128k+ for Llama-3)
    temperature: positive finite float
    y = exp(x / T - max(x / T)) / sum(exp(x / T - max(x / T))) over the last dim, math in float32;
    y has x's shape and dtype (pass float32 logits for float32 probabilities). -inf logits (masked
    tokens) get probability 0; a row that is all -inf has no distribution and gives NaN, as
    torch.softmax does. Returns y.
"""

from __future__ import annotations

import math

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, row_count
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import (
    ONE_ROUNDING_POINTWISE,
    ONE_ROUNDING_TOLERANCE,
    compute_dtype,
    element_size,
    randn,
)


def softmax_reference(x, temperature=1.0):
    xf = x.to(compute_dtype(x.dtype)) / temperature
    return torch.softmax(xf, dim=-1).to(x.dtype)


def validate_softmax(x, temperature) -> None:
    check_tensor("softmax", "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    if x.shape[-1] == 0:
        raise ValueError(
            f"softmax: x has shape {tuple(x.shape)}; the last dim (softmax over it) must be non-empty"
        )
    if isinstance(temperature, torch.Tensor) or not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(
            f"softmax: temperature must be a positive finite float, got {temperature!r} "
            "(greedy sampling is argmax, not softmax at temperature 0)"
        )


def _make_inputs(shape, dtype, device, generator):
    rows, cols = shape["rows"], shape["cols"]
    # Logits with a spread like a real LM head's (std ~3) so exp() sees a wide range.
    x = randn((rows, cols), torch.float32, "cpu", generator, scale=3.0)
    if shape.get("masked"):
        # Mask about a third of the entries to -inf (as top-k / top-p filtering does), never a whole row.
        drop = torch.rand((rows, cols), generator=generator) < 0.35
        drop[:, torch.randint(0, cols, (1,), generator=generator)] = False
        x = x.masked_fill(drop, float("-inf"))
    return {"x": x.to(dtype=dtype, device=device), "temperature": shape.get("temperature", 1.0)}


def _fuzz_shapes(rng):
    shapes = [
        {"rows": 1, "cols": 1},
        {"rows": 5, "cols": 49152, "temperature": 0.7},  # SmolLM2 vocabulary, looped path
        {"rows": 3, "cols": 777, "masked": True},
        {"rows": 2, "cols": 20011, "masked": True, "temperature": 1.3},
    ]
    shapes += [
        {
            "rows": rng.randint(1, 64),
            "cols": rng.randint(1, 5000),
            "masked": rng.random() < 0.4,
            "temperature": rng.choice([1.0, 0.5, 2.0]),
        }
        for _ in range(3)
    ]
    return shapes


def _bytes(shape, dtype):
    return 2 * shape["rows"] * shape["cols"] * element_size(dtype)


def _llm_shapes():
    # Sampling: batch of decode rows over the vocab (SmolLM2 49152, Llama-3 128256); attention-score
    # sized rows for the prefill case. No temperature key: it does not change the work, and the tuned
    # configs are looked up by {"rows", "cols"} alone.
    return [{"rows": rows, "cols": vocab} for vocab in (49152, 128256) for rows in (1, 64, 256)] + [
        {"rows": 4096, "cols": 4096}
    ]


def _torch_eager(x, temperature=1.0):
    return torch.softmax(x.float() / temperature, dim=-1).to(x.dtype)


SOFTMAX = OpSpec(
    name="softmax",
    description="softmax(x / temperature) over the last dim, float32 math",
    reference=softmax_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # fp32: exp() of arguments up to ~30 in magnitude, ~1 ulp each, plus summation order;
    # halves: one rounding of each probability (2^-11, 2^-8).
    tolerance=ONE_ROUNDING_TOLERANCE,
    pointwise=ONE_ROUNDING_POINTWISE,
    flops=lambda s, dtype: 5 * s["rows"] * s["cols"],  # scale, max, sub+exp, sum, divide
    bytes=_bytes,
    bench_shapes={"llm": _llm_shapes()},
    baselines={"torch_eager": _torch_eager},
    schema="(Tensor x, float temperature=1.0) -> Tensor",
    validate=validate_softmax,
    fake=lambda x, temperature: torch.empty_like(x),
    call_case=lambda x, temperature: ({"rows": row_count(x), "cols": x.shape[-1]}, x.dtype),
    doc=__doc__,
)

softmax = define_op(SOFTMAX, "kiln.ops")
