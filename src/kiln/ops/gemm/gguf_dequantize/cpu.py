"""CPU gguf_dequantize: kiln.quant's torch decoder (bit-exact with `gguf.quants` in float32); other
GGML types through the gguf package."""

from __future__ import annotations

import torch

from kiln.ops.gemm.gguf_blocks import QTYPES, dequantize_on_host
from kiln.ops.gemm.gguf_dequantize.spec import GGUF_DEQUANTIZE
from kiln.ops.registry import Implementation, cpu_only
from kiln.quant.gguf_blocks import dequantize_blocks


def gguf_dequantize_cpu(qweight, qtype, dtype=torch.float32):
    if qtype not in QTYPES:
        return dequantize_on_host(qweight, qtype, dtype)
    return dequantize_blocks(qweight, qtype, dtype)


GGUF_DEQUANTIZE.register(Implementation("cpu", gguf_dequantize_cpu, cpu_only))
