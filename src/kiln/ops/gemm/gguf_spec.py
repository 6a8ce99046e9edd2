"""GGUF block-quantized weights as stored in the file: dequantize, and the fused dequant-GEMM.

Block formats (32 weights per block, one output row's K/32 blocks contiguous; see kiln.quant.gguf_blocks):
    Q4_0: fp16 d, 16 bytes of nibbles        w = d * (q - 8)      18 bytes
    Q4_1: fp16 d, fp16 m, 16 bytes           w = d * q + m        20 bytes
    Q8_0: fp16 d, 32 int8                    w = d * q            34 bytes
Byte j of a block's nibbles holds weight j (low nibble) and weight j + 16 (high nibble).

gguf_dequantize(qweight, qtype, dtype=torch.float32)
    qweight: uint8 [N, row_bytes], row_bytes = K / 32 * block bytes -> [N, K] in dtype.
    Q4_0 / Q4_1 / Q8_0 run the kernels (float32 math without FMA contraction: float32 output is
    bit-exact with `gguf.quants.dequantize`). Any other GGML type name ("Q6_K", "Q5_0", "F16", ...)
    falls back to `gguf.quants.dequantize` on the host, then moves to qweight's device.

gguf_linear(x, qweight, qtype, bias=None)
    x [..., K] float32 / float16 / bfloat16, qweight uint8 [N, row_bytes] (Q4_0 / Q4_1 / Q8_0),
    bias [N] or None -> x @ W^T + bias, [..., N] in x's dtype. K must be a multiple of 32 (GGUF's).
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor
from kiln.ops.gemm.shapes import GEMM_TOLERANCE, fuzz_gemm_shapes, gemm_flops, llm_shapes
from kiln.ops.registry import OpSpec, register_op
from kiln.ops.testing import element_size, randn
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_SIZE, KERNEL_QTYPES, dequantize_blocks, quantize_blocks

QTYPES = KERNEL_QTYPES


def gguf_dequantize_reference(qweight, qtype, dtype=torch.float32):
    """Exact decode in float64 (dtype is what kernels round to)."""
    return dequantize_blocks(qweight, qtype, torch.float64)


def gguf_linear_reference(x, qweight, qtype, bias=None):
    out = x @ dequantize_blocks(qweight, qtype, x.dtype).T
    return out if bias is None else out + bias


def validate_gguf_weight(op: str, qweight, qtype: str, K: int | None, device=None) -> None:
    check_tensor(op, "qweight", qweight, ndim=2, dtypes=(torch.uint8,), device=device)
    if qtype not in QTYPES:
        raise ValueError(f"{op}: qtype {qtype!r} unsupported, expected one of {', '.join(QTYPES)}")
    block = BLOCK_BYTES[qtype]
    if qweight.shape[1] % block:
        raise ValueError(
            f"{op}: qweight rows have {qweight.shape[1]} bytes, not whole {block}-byte {qtype} blocks"
        )
    if K is not None:
        if K % BLOCK_SIZE:
            raise ValueError(f"{op}: K={K} must be a multiple of {BLOCK_SIZE} (GGUF block size)")
        if qweight.shape[1] != K // BLOCK_SIZE * block:
            raise ValueError(
                f"{op}: qweight rows have {qweight.shape[1]} bytes, expected K/32 * {block} = "
                f"{K // BLOCK_SIZE * block} for K={K} ({qtype})"
            )


def _make_weight(shape, device, generator):
    N, K = shape["N"], shape["K"]
    # Encode fresh random floats: raw random bytes would make inf/NaN block scales.
    weight = torch.randn((N, K), generator=generator) * K**-0.5
    weight[:, ::7] *= 3.0  # uneven blocks: the largest element differs in sign and size block to block
    return quantize_blocks(weight, shape["qtype"]).to(device)


def _make_dequantize_inputs(shape, dtype, device, generator):
    return {"qweight": _make_weight(shape, device, generator), "qtype": shape["qtype"], "dtype": dtype}


def _make_linear_inputs(shape, dtype, device, generator):
    return {
        "x": randn((shape["M"], shape["K"]), dtype, device, generator),
        "qweight": _make_weight(shape, device, generator),
        "qtype": shape["qtype"],
        "bias": randn((shape["N"],), dtype, device, generator) if shape.get("bias") else None,
    }


def _dequantize_fuzz(rng):
    shapes = [
        {"N": 1, "K": 32},
        {"N": 7, "K": 96},
        {"N": 33, "K": 320},
        {"N": rng.randint(1, 60), "K": 32 * rng.randint(1, 12)},
    ]
    return [{**s, "qtype": q} for s in shapes for q in QTYPES]


def _linear_fuzz(rng):
    shapes = fuzz_gemm_shapes(rng, k_multiple=BLOCK_SIZE)
    return [{**s, "qtype": QTYPES[i % 3], "bias": i % 2 == 1} for i, s in enumerate(shapes)] + [
        {"M": 1, "N": 45, "K": 160, "qtype": q} for q in QTYPES
    ]


def _packed_bytes(shape) -> int:
    return shape["N"] * shape["K"] // BLOCK_SIZE * BLOCK_BYTES[shape["qtype"]]


def _torch_dequant_matmul(x, qweight, qtype, bias=None):
    return torch.nn.functional.linear(x, dequantize_blocks(qweight, qtype, x.dtype), bias)


GGUF_DEQUANTIZE = register_op(
    OpSpec(
        name="gguf_dequantize",
        description="GGUF Q4_0/Q4_1/Q8_0 blocks -> dense [N, K]",
        reference=gguf_dequantize_reference,
        make_inputs=_make_dequantize_inputs,
        fuzz_shapes=_dequantize_fuzz,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # d*q is exact in float32 (11 + 5 bits); Q4_1's "+ m" rounds once (2^-24); halves round the
        # output once (2^-11, 2^-8).
        tolerance={torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3},
        flops=lambda s, dtype: 2.0 * s["N"] * s["K"],
        bytes=lambda s, dtype: _packed_bytes(s) + s["N"] * s["K"] * element_size(dtype),
        bench_shapes={
            "llm": [{"N": n, "K": k, "qtype": q} for k, n in ((4096, 14336), (576, 49152)) for q in QTYPES]
        },
    )
)

GGUF_LINEAR = register_op(
    OpSpec(
        name="gguf_linear",
        description="fused GGUF block dequant + GEMM (GEMV path for decode)",
        reference=gguf_linear_reference,
        make_inputs=_make_linear_inputs,
        fuzz_shapes=_linear_fuzz,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # Weights dequantized in float32 and rounded to x's dtype for the dot: as a dense GEMM.
        tolerance=GEMM_TOLERANCE,
        flops=gemm_flops,
        bytes=lambda s, dtype: _packed_bytes(s) + (s["M"] * s["K"] + s["M"] * s["N"]) * element_size(dtype),
        bench_shapes={"llm": [{**s, "qtype": q} for s in llm_shapes() for q in ("Q4_1", "Q8_0")]},
        baselines={"torch_dequant_matmul": _torch_dequant_matmul},
        gpu_only_dtypes={"triton": (torch.bfloat16,)},
    )
)


def gguf_dequantize(qweight: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 `[N, row_bytes]` GGUF rows -> `[N, K]` in dtype (other GGML types: host fallback)."""
    if qtype not in QTYPES:
        from kiln.quant.gguf_blocks import dequantize_any

        check_tensor("gguf_dequantize", "qweight", qweight, min_ndim=1)
        values = dequantize_any(qweight, qtype)
        return values.reshape(qweight.shape[0], -1).to(device=qweight.device, dtype=dtype)
    validate_gguf_weight("gguf_dequantize", qweight, qtype, None)
    if dtype not in FLOAT_DTYPES + (torch.float64,):
        raise ValueError(f"gguf_dequantize: dtype {dtype} unsupported, expected float32, float16 or bfloat16")
    return GGUF_DEQUANTIZE(qweight, qtype, dtype)


def gguf_linear(
    x: torch.Tensor, qweight: torch.Tensor, qtype: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x `[..., K]` @ dequant(qweight `[N, row_bytes]`)^T (+ bias) -> `[..., N]` in x's dtype."""
    op = "gguf_linear"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    validate_gguf_weight(op, qweight, qtype, x.shape[-1], x.device)
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device)
        if bias.shape[0] != qweight.shape[0]:
            raise ValueError(
                f"{op}: bias has {bias.shape[0]} elements, expected out-features {qweight.shape[0]}"
            )
    return GGUF_LINEAR(x, qweight, qtype, bias)
