"""fp8_block_linear: block-scaled FP8 (DeepSeek-V3 / Qwen3-FP8 style) W8A8 GEMM, activations
quantized inside the op per token and per group of block_k inputs.

    x:        [M, K] float32 / float16 / bfloat16
    w_fp8:    [N, K] float8_e4m3fn
    w_scale:  float32 [ceil(N / block_n), ceil(K / block_k)]: one scale per (block_n x block_k) block
              (the checkpoints' `weight_scale_inv`: the factor that multiplies the stored values)
    block_n, block_k: the weight's block (block_k a power of two, 16..256)
    bias:     [N] or None; out_dtype: float32 / float16 / bfloat16
    For each token m and group g of block_k inputs: s[m, g] = max(amax |x[m, g*bk : (g+1)*bk]|,
    1e-12) / 448, x_q = x / s rounded to e4m3 (nearest even), then
    y[m, n] = sum_g s[m, g] * w_scale[n // bn, g] * sum_{k in g} x_q[m, k] * w_fp8[n, k]  (+ bias),
    [M, N] in out_dtype, float32 accumulation.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of, row_count
from kiln.ops.gemm.dense_baseline import bf16_matmul
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from kiln.ops.gemm.shapes import FP8_FLOAT32_TOLERANCE, GEMM_TOLERANCE, LLAMA3_8B, gemm_flops, quant_shapes
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size, randn, uniform

BLOCK_K_SIZES = (16, 32, 64, 128, 256)


def quantize_groups_reference(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [M, K] -> the dequantized x_q * s the op multiplies (per token and group of block_k), in
    float64 for float64 x, float32 otherwise. The quantizer is defined in float32, as every backend
    runs it (x's values are exact in float32): an x / scale that lands on a rounding tie between two
    e4m3 values (common with fp16 / bf16 inputs) must round as the float32 quotient does."""
    out = torch.float64 if x.dtype == torch.float64 else torch.float32
    M, K = x.shape
    groups = -(-K // block_k)
    padded = torch.zeros((M, groups * block_k), dtype=torch.float32, device=x.device)
    padded[:, :K] = x.to(torch.float32)
    g = padded.reshape(M, groups, block_k)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.to(out) * scale.to(out)).reshape(M, groups * block_k)[:, :K]


def block_scales(w_scale: torch.Tensor, N: int, K: int, block_n: int, block_k: int) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] block scales -> [N, K], one per weight."""
    return w_scale.repeat_interleave(block_n, 0)[:N].repeat_interleave(block_k, 1)[:, :K]


def fp8_block_linear_reference(x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=torch.bfloat16):
    """Exact products of the quantized activations and the dequantized weight (float64 under the
    verifier); out_dtype only says what the kernels round to."""
    xq = quantize_groups_reference(x, block_k)
    N, K = w_fp8.shape
    w = w_fp8.to(xq.dtype) * block_scales(w_scale.to(xq.dtype), N, K, block_n, block_k)
    out = xq @ w.T
    return out if bias is None else out + bias.to(out.dtype)


def validate_fp8_block_linear(x, w_fp8, w_scale, block_n, block_k, bias, out_dtype) -> None:
    op = "fp8_block_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    device = device_of(x)
    check_tensor(op, "w_fp8", w_fp8, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    check_tensor(op, "w_scale", w_scale, ndim=2, dtypes=(torch.float32, torch.float64), device=device)
    if block_k not in BLOCK_K_SIZES:
        raise ValueError(f"{op}: block_k {block_k} unsupported, expected one of {BLOCK_K_SIZES}")
    if block_n < 1:
        raise ValueError(f"{op}: block_n {block_n}, expected >= 1")
    N, K = w_fp8.shape
    if K != x.shape[1]:
        raise ValueError(f"{op}: w_fp8 has {K} in-features, expected x's K = {x.shape[1]}")
    expected = (-(-N // block_n), -(-K // block_k))
    if tuple(w_scale.shape) != expected:
        raise ValueError(
            f"{op}: w_scale has shape {tuple(w_scale.shape)}, expected [ceil(N/block_n), ceil(K/block_k)] "
            f"= {list(expected)}"
        )
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, device=device)
        if bias.shape[0] != N:
            raise ValueError(f"{op}: bias has {bias.shape[0]} elements, expected out-features {N}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: out_dtype {out_dtype} unsupported, expected float32, float16 or bfloat16")


def _fake(x, w_fp8, w_scale, block_n, block_k, bias, out_dtype):
    return x.new_empty((x.shape[0], w_fp8.shape[0]), dtype=out_dtype)


def _make_inputs(shape, dtype, device, generator):
    M, N, K = shape["M"], shape["N"], shape["K"]
    bn, bk = shape.get("block_n", 128), shape.get("block_k", 128)
    w = randn((N, K), torch.float32, device, generator, scale=40.0).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale_shape = (-(-N // bn), -(-K // bk))
    return {
        "x": randn((M, K), dtype, device, generator),
        "w_fp8": w,
        "w_scale": uniform(scale_shape, 0.5, 1.5, torch.float32, device, generator) * (K**-0.5 / 40.0),
        "block_n": bn,
        "block_k": bk,
        "bias": randn((N,), dtype, device, generator) if shape.get("bias") else None,
        "out_dtype": dtype,
    }


def _fuzz_shapes(rng):
    """Partial blocks in N and K, M = 1 (decode), small blocks so a few programs cover several."""
    shapes = [
        {"M": 1, "N": 150, "K": 200},
        {"M": 5, "N": 130, "K": 257, "bias": True},
        {"M": 33, "N": 40, "K": 96, "block_n": 16, "block_k": 32},
        {"M": 3, "N": 70, "K": 64, "block_n": 32, "block_k": 16, "bias": True},
    ]
    shapes.append({"M": rng.randint(1, 40), "N": rng.randint(1, 200), "K": rng.randint(1, 300)})
    return shapes


def _bytes(shape, dtype):
    M, N, K = shape["M"], shape["N"], shape["K"]
    return N * K + (M * K + M * N) * element_size(dtype)


def _dequant_matmul(x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=torch.bfloat16):
    """What a framework without a block-FP8 kernel does: dequantize W to x's dtype, then cuBLAS
    (activations left unquantized)."""
    N, K = w_fp8.shape
    w = (w_fp8.to(torch.float32) * block_scales(w_scale.float(), N, K, block_n, block_k)).to(x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype)).to(out_dtype)


def _bf16_matmul(x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=torch.bfloat16):
    """The same layer as a bf16 GEMM on the dequantized weight (dense_baseline)."""
    N, K = w_fp8.shape

    def dense():
        return w_fp8.to(torch.float32) * block_scales(w_scale.float(), N, K, block_n, block_k)

    return bf16_matmul(x, w_fp8, dense, bias)


FP8_BLOCK_LINEAR = OpSpec(
    name="fp8_block_linear",
    description="block-scaled FP8 W8A8 GEMM (128x128 weight blocks, x quantized per token and group)",
    reference=fp8_block_linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),  # x and out_dtype
    # The reference quantizes x as the kernels do, in float32; fp32 accumulation and the output rounding
    # remain. fp16: XLA may compute the scale or the quotient another way than torch (the JAX backends
    # rounded an fp16 element sitting on an e4m3 tie to its other neighbour: one step, 2^-3 of that
    # element, ~1e-3 of a K=96 row); measured worst 3.6e-3 over 120 seeds (torch's CPU path 2.2e-4).
    # bf16 likewise: 5.2e-3 in norm and 1.7e-2 of the largest output in one element (CPU path 1.7e-3).
    # float32: Hopper's fp8 accumulator (FP8_FLOAT32_TOLERANCE).
    tolerance={
        **GEMM_TOLERANCE,
        torch.float32: FP8_FLOAT32_TOLERANCE,
        torch.float16: 6e-3,
        torch.bfloat16: 1.6e-2,
    },
    # one flipped tie moves one output element by up to 2^-3 of one product: in fp16 too the largest
    # element error is bf16's (measured 1.21e-2 of max |ref| in fp16 under XLA, 2x the norm bound)
    max_tolerance={torch.float16: 3.2e-2},
    flops=gemm_flops,
    matmul_dtype=lambda shape, dtype: torch.float8_e4m3fn,  # dtype is the output's
    bytes=_bytes,
    bench_shapes={
        "llm": [{"M": m, "N": n, "K": k} for k, n in LLAMA3_8B for m in (1, 16, 256, 2048)],
        "quant": quant_shapes(),
    },
    baselines={"torch_dequant_linear": _dequant_matmul, "torch_bf16_matmul": _bf16_matmul},
    schema=(
        "(Tensor x, Tensor w_fp8, Tensor w_scale, int block_n, int block_k, Tensor? bias=None, "
        "ScalarType out_dtype=bfloat16) -> Tensor"
    ),
    validate=validate_fp8_block_linear,
    fake=_fake,
    call_case=lambda x, w_fp8, w_scale, block_n, block_k, bias, out_dtype: (
        {"M": row_count(x), "N": w_fp8.shape[0], "K": x.shape[-1], "block_n": block_n, "block_k": block_k},
        out_dtype,
    ),
    doc=__doc__,
)

fp8_block_linear = define_op(FP8_BLOCK_LINEAR, "kiln.ops")
