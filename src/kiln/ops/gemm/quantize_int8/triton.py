"""Triton quantize_int8: the W8A8 row quantizer of ../scaled_triton.py (one program per row: amax,
scale, round half away from zero), per token."""

from __future__ import annotations

import torch

from kiln.ops.gemm.quantize_int8.spec import QUANTIZE_INT8
from kiln.ops.gemm.scaled import INT8_MAX
from kiln.ops.gemm.scaled_triton import quantize_rows
from kiln.ops.registry import Implementation, triton_available


def quantize_int8_triton(x):
    return quantize_rows(x, True, torch.int8, INT8_MAX)


QUANTIZE_INT8.register(Implementation("triton", quantize_int8_triton, triton_available))
