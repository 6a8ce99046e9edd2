"""gguf_linear: the fused GGUF block dequant + GEMM, weights read as stored in the file.

x:       [..., K] float32 / float16 / bfloat16; K a multiple of the qtype's block: 32, or 256 for
         the K-quants (their super-block size)
qweight: uint8 [N, row_bytes] of GGUF blocks (formats: gguf_dequantize's spec)
qtype:   "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K" or "Q6_K"
bias:    [N] in x's dtype, or None
y = x @ W^T + bias, [..., N] in x's dtype; W decoded in float32, accumulation in float32.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of, row_count
from kiln.ops.gemm.dense_baseline import bf16_matmul
from kiln.ops.gemm.gguf_blocks import make_gguf_weight, packed_bytes, validate_gguf_weight
from kiln.ops.gemm.gguf_dequantize.spec import gguf_dequantize_reference
from kiln.ops.gemm.shapes import (
    GEMM_TOLERANCE,
    LLAMA3_8B,
    fuzz_gemm_shapes,
    gemm_flops,
    llm_shapes,
    quant_shapes,
)
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import clone_inputs, element_size, randn
from kiln.quant.gguf_blocks import BLOCK_SIZE, K_QUANTS, QK_K, dequantize_blocks

QTYPES_32 = ("Q4_0", "Q4_1", "Q8_0")
QUANT_QTYPES = ("Q4_1", "Q8_0", *K_QUANTS)  # the "quant" suite: the embedded model's and Q4_K_M files'


def gguf_linear_reference(x, qweight, qtype, bias=None):
    """x @ W^T (+ bias) in x's dtype (float64 under the verifier), W decoded by the gguf package
    (gguf_dequantize's reference), not by kiln.quant.gguf_blocks, which the CPU path runs."""
    out = x @ gguf_dequantize_reference(qweight, qtype).to(x.dtype).T
    return out if bias is None else out + bias


def validate_gguf_linear(x, qweight, qtype, bias) -> None:
    op = "gguf_linear"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    validate_gguf_weight(op, qweight, qtype, x.shape[-1], device_of(x))
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, dtypes=(x.dtype,), device=device_of(x))
        if bias.shape[0] != qweight.shape[0]:
            raise ValueError(
                f"{op}: bias has {bias.shape[0]} elements, expected out-features {qweight.shape[0]}"
            )


def _make_inputs(shape, dtype, device, generator):
    return {
        "x": randn((shape["M"], shape["K"]), dtype, device, generator),
        "qweight": make_gguf_weight(shape, device, generator),
        "qtype": shape["qtype"],
        "bias": randn((shape["N"],), dtype, device, generator) if shape.get("bias") else None,
    }


def _fuzz_shapes(rng):
    shapes = fuzz_gemm_shapes(rng, k_multiple=BLOCK_SIZE)
    legacy = [{**s, "qtype": QTYPES_32[i % 3], "bias": i % 2 == 1} for i, s in enumerate(shapes)] + [
        {"M": 1, "N": 45, "K": 160, "qtype": q} for q in QTYPES_32
    ]
    # K-quants: K in whole 256-weight super-blocks; decode (GEMV) and tiled-GEMM row counts
    super_blocks = [
        {"M": 1, "N": 37, "K": 512, "qtype": "Q4_K", "bias": True},
        {"M": 3, "N": 29, "K": 256, "qtype": "Q5_K"},
        {"M": 17, "N": 21, "K": 256, "qtype": "Q6_K", "bias": True},
        {"M": 9, "N": 19, "K": 512, "qtype": "Q5_0"},
        {"M": rng.randint(1, 40), "N": rng.randint(1, 60), "K": QK_K * rng.randint(1, 2),
         "qtype": K_QUANTS[rng.randrange(3)]},
    ]  # fmt: skip
    return legacy + super_blocks


def _bench_shapes():
    """The 32-block types on every llm shape; the K-quants (what Q4_K_M files hold) at decode
    (M = 1..16) and prefill sizes of Llama-3-8B's projections (every K a multiple of 256)."""
    legacy = [{**s, "qtype": q} for s in llm_shapes() for q in ("Q4_1", "Q8_0")]
    k_quants = [
        {"M": m, "N": n, "K": k, "qtype": q} for k, n in LLAMA3_8B for m in (1, 4, 16, 2048) for q in K_QUANTS
    ]
    return legacy + k_quants


def _torch_dequant_matmul(x, qweight, qtype, bias=None):
    return torch.nn.functional.linear(x, dequantize_blocks(qweight, qtype, x.dtype), bias)


def _bf16_matmul(x, qweight, qtype, bias=None):
    """The same layer as a bf16 GEMM on the dequantized weight (dense_baseline)."""
    return bf16_matmul(x, qweight, lambda: dequantize_blocks(qweight, qtype, torch.float32), bias)


GGUF_LINEAR = OpSpec(
    name="gguf_linear",
    description="fused GGUF block dequant + GEMM (GEMV path for decode)",
    reference=gguf_linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # Weights dequantized in float32 and rounded to x's dtype for the dot: as a dense GEMM.
    tolerance=GEMM_TOLERANCE,
    requires=("gguf",),  # the reference decodes with gguf.quants
    flops=gemm_flops,
    bytes=lambda s, dtype: packed_bytes(s) + (s["M"] * s["K"] + s["M"] * s["N"]) * element_size(dtype),
    bench_shapes={
        "llm": _bench_shapes(),
        "quant": [{**s, "qtype": q} for s in quant_shapes() for q in QUANT_QTYPES],
    },
    baselines={"torch_dequant_matmul": _torch_dequant_matmul, "torch_bf16_matmul": _bf16_matmul},
    gpu_only_dtypes={"triton": (torch.bfloat16,)},
    schema="(Tensor x, Tensor qweight, str qtype, Tensor? bias=None) -> Tensor",
    validate=validate_gguf_linear,
    copy_inputs=clone_inputs,  # the K-quant encoder runs on the host: seconds per 8B weight
    fake=lambda x, qweight, qtype, bias: x.new_empty((*x.shape[:-1], qweight.shape[0])),
    call_case=lambda x, qweight, qtype, bias: (
        {"M": row_count(x), "N": qweight.shape[0], "K": x.shape[-1], "qtype": qtype},
        x.dtype,
    ),
    doc=__doc__,
)

gguf_linear = define_op(GGUF_LINEAR, "kiln.ops")
