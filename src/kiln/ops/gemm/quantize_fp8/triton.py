"""Triton quantize_fp8: the W8A8 row quantizer of ../scaled_triton.py (one program per row; per
tensor, a first kernel reduces the global amax), rounding onto the e4m3 grid to nearest even."""

from __future__ import annotations

from kiln.ops.gemm.quantize_fp8.spec import QUANTIZE_FP8
from kiln.ops.gemm.scaled import FP8_DTYPE, FP8_MAX
from kiln.ops.gemm.scaled_triton import quantize_rows
from kiln.ops.registry import Implementation, triton_available


def quantize_fp8_triton(x, per_token=True):
    return quantize_rows(x, per_token, FP8_DTYPE, FP8_MAX)


QUANTIZE_FP8.register(Implementation("triton", quantize_fp8_triton, triton_available))
