"""w8a16_linear: int8 weights with per-output-channel scales times half/float activations (W8A16).

    x:            [..., K]  float32 / float16 / bfloat16
    weight:       [N, K]    int8, the checkpoint's [out, in] layout (symmetric, zero point 0)
    weight_scale: [N, 1] or [N] float32: real weight row n = weight[n] * weight_scale[n]
    bias:         [N] or None, x's dtype
    y = x @ (weight * weight_scale)^T + bias, shape [..., N], x's dtype; accumulation in float32.
The weight stays one byte per element in memory; kernels widen it tile by tile (int8 values are exact
in bf16 and fp16) and apply the scale to the float32 accumulator once per output element.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_last_dim, check_same_dtype, check_tensor, device_of, row_count
from kiln.ops.gemm.shapes import GEMM_TOLERANCE, fuzz_gemm_shapes, gemm_flops, llm_shapes, quant_shapes
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import compute_dtype, element_size, randn


def w8a16_linear_reference(x, weight, weight_scale, bias=None):
    dtype = compute_dtype(x.dtype)
    w = weight.to(dtype) * weight_scale.reshape(-1, 1).to(dtype)
    out = x.to(dtype) @ w.T
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(x.dtype)


def validate_w8a16_linear(x, weight, weight_scale, bias) -> None:
    op, device = "w8a16_linear", device_of(x)
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    check_tensor(op, "weight", weight, ndim=2, dtypes=(torch.int8,), device=device)
    check_last_dim(op, "weight", weight, x.shape[-1], "x's in-features")
    check_tensor(
        op, "weight_scale", weight_scale, ndim=(1, 2), dtypes=(torch.float32, torch.float64), device=device
    )
    n = weight.shape[0]
    if tuple(weight_scale.shape) not in ((n,), (n, 1)):
        raise ValueError(
            f"{op}: weight_scale has shape {tuple(weight_scale.shape)}, "
            f"expected [{n}, 1] or [{n}] (one per output row)"
        )
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, device=device)
        check_last_dim(op, "bias", bias, n, "weight's out-features")
        check_same_dtype(op, x=x, bias=bias)


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (weight int8 [N, K], scale float32 [N, 1]) with w ~ weight * scale."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    weight = torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8)
    return weight, scale


def _make_inputs(shape, dtype, device, generator):
    m, n, k = shape["M"], shape["N"], shape["K"]
    weight, scale = quantize_weight_int8(randn((n, k), torch.float32, "cpu", generator, scale=k**-0.5))
    return {
        "x": randn((m, k), dtype, device, generator),
        "weight": weight.to(device),
        "weight_scale": scale.to(device),
        "bias": randn((n,), dtype, device, generator) if shape.get("bias") else None,
    }


def _fuzz_shapes(rng):
    return [{**s, "bias": i % 2 == 1} for i, s in enumerate(fuzz_gemm_shapes(rng))]


def _bytes(shape, dtype):
    m, n, k = shape["M"], shape["N"], shape["K"]
    return (m * k + m * n + (n if shape.get("bias") else 0)) * element_size(dtype) + n * k + 4 * n


W8A16_LINEAR = OpSpec(
    name="w8a16_linear",
    description="int8 weight x float activation linear with per-output-channel scales (W8A16)",
    reference=w8a16_linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # Same budget as the dense GEMMs: fp32 accumulation, then one rounding of the dequantized
    # weight (CPU path) and one of the output in x's dtype; see kiln.ops.gemm.shapes.
    tolerance=GEMM_TOLERANCE,
    flops=gemm_flops,
    bytes=_bytes,
    bench_shapes={"llm": llm_shapes(), "quant": quant_shapes()},
    # baselines: "torch_dequant_linear" (the CPU path itself, PyTorch's dequantize + F.linear) is
    # added by cpu.py.
    schema="(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias=None) -> Tensor",
    validate=validate_w8a16_linear,
    fake=lambda x, weight, weight_scale, bias: x.new_empty((*x.shape[:-1], weight.shape[0])),
    call_case=lambda x, weight, weight_scale, bias: (
        {"M": row_count(x), "N": weight.shape[0], "K": x.shape[-1], "bias": bias is not None},
        x.dtype,
    ),
    doc=__doc__,
)

w8a16_linear = define_op(W8A16_LINEAR, "kiln.ops")
