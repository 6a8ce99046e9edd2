"""Shapes shared by the GEMM specs: the "llm" bench suite, fuzz shapes, tolerances, FLOP and byte counts."""

from __future__ import annotations

import torch

from kiln.ops.testing import ONE_ROUNDING_TOLERANCE, element_size

# (K, N) of the linear layers: [in, out] as y = x @ W^T.
LLAMA3_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # qkv, o, gate_up, down
SMOLLM2_135M = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
BENCH_M = (1, 16, 64, 256, 2048, 8192)

# Relative-norm error against the float64 product of the same (already quantized) inputs: the fp32
# accumulation contributes ~sqrt(K) * 2^-24, so what dominates for halves is one rounding of the output
# (ONE_ROUNDING_TOLERANCE: 2u; a half-precision accumulator over K = 4096 errs by ~sqrt(K) u).
GEMM_TOLERANCE = ONE_ROUNDING_TOLERANCE
# fp8 GEMMs with a float32 output: Hopper's fp8 wgmma adds each k32 step's products in an accumulator
# narrower than float32 (~14 mantissa bits, 2^-14 = 6.1e-5) before the kernels promote to float32. On
# an H200 (2026-11-29, triton 3.6) the Triton kernels measured 3.5e-5..4.5e-5 in norm and up to
# 7.0e-5 of max |ref| in one element (M = 26..65, K = 40..169): float32's 1e-5 cannot hold, fp16's
# output rounding (6e-3) is far looser. 1e-4 is ~2x the measured norm error, its 2x element bound ~3x.
FP8_FLOAT32_TOLERANCE = 1e-4


QUANT_M = (1, 16, 2048)  # decode (one sequence, a batch of 16) and a prefill chunk


def quant_shapes(**extra) -> list[dict]:
    """The "quant" suite: Llama-3-8B's four projections at QUANT_M, the GEMM formats side by side in one
    short GPU run (gpu_check's quant phase)."""
    return [{"M": m, "N": n, "K": k, **extra} for k, n in LLAMA3_8B for m in QUANT_M]


def llm_shapes(**extra) -> list[dict]:
    """Llama-3-8B and SmolLM2-135M linear layers at decode (M=1..64) and prefill (M=256..8192) sizes."""
    return [{"M": m, "N": n, "K": k, **extra} for k, n in LLAMA3_8B + SMOLLM2_135M for m in BENCH_M]


def fuzz_gemm_shapes(rng, k_multiple: int = 1, **extra) -> list[dict]:
    """Odd sizes that exercise every mask, M = 1 (decode) and a split-K sized case; kept small because
    the Triton interpreter pays per program. `k_multiple` rounds K for formats that need it.

    The last case has a long K (8192; M x N small, so it stays cheap): a GEMM that adds its K-chunk
    partials in the output's half dtype errs by ~sqrt(K / chunk) / 2 roundings, under GEMM_TOLERANCE
    (2u) for K ~ 300, but at K = 8192 over chunks of 64 it measures 2.5u to 4u in norm (100 of 100
    seeds fail, fp16 and bf16), where an fp32 accumulator stays at one rounding of the output (~0.5u).
    Without a bias: one as large as the product would halve the relative error."""

    def k(value: int) -> int:
        return max(k_multiple, value // k_multiple * k_multiple)

    shapes = [
        {"M": 1, "N": 37, "K": k(200)},
        {"M": 3, "N": 70, "K": k(96)},
        {"M": 17, "N": 33, "K": k(77)},
        {"M": 65, "N": 19, "K": k(40)},
    ]
    shapes += [{"M": rng.randint(1, 80), "N": rng.randint(1, 100), "K": k(rng.randint(1, 300))}]
    shapes += [{"M": 3, "N": 40, "K": k(8192)}]  # sixth: linear adds a bias to even-numbered shapes
    return [{**s, **extra} for s in shapes]


def gemm_flops(shape: dict, dtype: torch.dtype) -> float:
    return 2.0 * shape["M"] * shape["N"] * shape["K"]


def dense_gemm_bytes(shape: dict, dtype: torch.dtype, weight_rows: int = 1) -> float:
    """x, the [weight_rows * N, K] weight and the output read/written once in `dtype` (+ the bias)."""
    M, N, K = shape["M"], shape["N"], shape["K"]
    return (M * K + weight_rows * N * K + M * N + (N if shape.get("bias") else 0)) * element_size(dtype)


def fuzz_scaled_gemm_shapes(rng) -> list[dict]:
    """fuzz_gemm_shapes for the W8A8 GEMMs (fp8_linear, int8_linear): bias on every other shape,
    per-token x per-channel scales on two of three (per-tensor on the rest)."""
    return [{**s, "bias": i % 2 == 1, "per_token": i % 3 != 2} for i, s in enumerate(fuzz_gemm_shapes(rng))]


def scaled_gemm_bytes(shape: dict, dtype: torch.dtype) -> float:
    """One-byte x and W read once, the [M, N] output written in `dtype` (the scales are negligible)."""
    return shape["M"] * shape["K"] + shape["N"] * shape["K"] + shape["M"] * shape["N"] * element_size(dtype)


def fuzz_quantize_shapes(rng) -> list[dict]:
    """[M, K] shapes for the activation quantizers: a single element, odd sizes, K past one block."""
    return [
        {"M": 1, "K": 1},
        {"M": 5, "K": 333},
        {"M": 3, "K": 5000},
        {"M": rng.randint(1, 40), "K": rng.randint(1, 2000)},
    ]


def quantize_flops(shape: dict, dtype: torch.dtype) -> float:
    return 3.0 * shape["M"] * shape["K"]


def quantize_bytes(shape: dict, dtype: torch.dtype) -> float:
    """x read in `dtype`, the one-byte values written, one float32 scale per row."""
    return shape["M"] * shape["K"] * (element_size(dtype) + 1) + 4 * shape["M"]
