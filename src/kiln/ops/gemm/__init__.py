"""GEMM ops: dense (linear, linear_silu_mul), weights prepared at load (prepared_linear), FP8 / INT8
W8A8 (quantize_*, *_linear), block-scaled FP8 (fp8_block_linear), int4 W4A16, GGUF blocks, W8A16
and 2:4 sparse (sparse24_linear). One folder per op (spec.py + a file
per backend); what the family shares: shapes.py (bench/fuzz shapes, tolerances, FLOP/byte models),
tiling.py (the Triton tiling, split-K and launch configs), scaled.py + scaled_triton.py (the W8A8 ops'
contract and kernels), gguf_blocks.py + gguf_triton.py (the GGUF weight contract and block decoder),
weight_formats.py (the layouts prepared_linear reads: oneDNN-packed, fp16 GEMV, int4, GGUF blocks)."""

from kiln.ops.gemm.fp8_block_linear import fp8_block_linear
from kiln.ops.gemm.fp8_linear import fp8_linear
from kiln.ops.gemm.gguf_dequantize import gguf_dequantize
from kiln.ops.gemm.gguf_linear import gguf_linear
from kiln.ops.gemm.int4_linear import int4_linear
from kiln.ops.gemm.int8_linear import int8_linear
from kiln.ops.gemm.linear import linear
from kiln.ops.gemm.linear_silu_mul import linear_silu_mul
from kiln.ops.gemm.prepared_linear import prepared_linear
from kiln.ops.gemm.quantize_fp8 import quantize_fp8
from kiln.ops.gemm.quantize_int8 import quantize_int8
from kiln.ops.gemm.sparse24_linear import sparse24_linear
from kiln.ops.gemm.w8a16_linear import w8a16_linear

__all__ = [
    "fp8_block_linear",
    "fp8_linear",
    "gguf_dequantize",
    "gguf_linear",
    "int4_linear",
    "int8_linear",
    "linear",
    "linear_silu_mul",
    "prepared_linear",
    "quantize_fp8",
    "quantize_int8",
    "sparse24_linear",
    "w8a16_linear",
]
