"""GEMM ops (see docs/contracts.md): dense `linear` / `linear_silu_mul`. Specs in *_spec.py, Triton
backends in *_triton.py, CPU paths in cpu.py."""

from kiln.ops.gemm import cpu, dense_triton, scaled_triton  # noqa: F401  (registers the implementations)
from kiln.ops.gemm.dense_spec import linear, linear_silu_mul
from kiln.ops.gemm.fp8_spec import fp8_linear, quantize_fp8
from kiln.ops.gemm.int8_spec import int8_linear, quantize_int8

__all__ = ["fp8_linear", "int8_linear", "linear", "linear_silu_mul", "quantize_fp8", "quantize_int8"]
