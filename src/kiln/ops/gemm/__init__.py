"""GEMM ops (see docs/contracts.md): dense, FP8 / INT8 (W8A8), int4 (W4A16) and GGUF block GEMMs.
Specs in *_spec.py, Triton backends in *_triton.py (shared tiling in tiling.py; the dense GEMM's
Hopper TMA variant in dense_tma.py), CPU paths in cpu.py."""

# Importing the backends registers them; library registers torch.ops.kiln.* for the public functions.
from kiln.ops.gemm import cpu, dense_triton, gguf_triton, int4_triton, library, scaled_triton  # noqa: F401
from kiln.ops.gemm.dense_spec import linear, linear_silu_mul
from kiln.ops.gemm.fp8_spec import fp8_linear, quantize_fp8
from kiln.ops.gemm.gguf_spec import gguf_dequantize, gguf_linear
from kiln.ops.gemm.int4_spec import int4_linear
from kiln.ops.gemm.int8_spec import int8_linear, quantize_int8

__all__ = [
    "fp8_linear",
    "gguf_dequantize",
    "gguf_linear",
    "int4_linear",
    "int8_linear",
    "linear",
    "linear_silu_mul",
    "quantize_fp8",
    "quantize_int8",
    "w8a16_linear",
]

from kiln.ops.gemm.w8a16 import w8a16_linear  # noqa: E402
