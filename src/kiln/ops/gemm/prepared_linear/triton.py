"""CUDA prepared_linear: the layouts `prepare_linear_weight` makes for CUDA: "gguf_planar_*" (the
engine's GGUF weights, repacked at load: ../gguf_planar.py) on ../gguf_planar_triton.py's GEMM; on other
ops' Triton kernels: "gguf_*" (GGUF blocks as stored in the file) on kiln.ops.gguf_linear, "dense" (a
matrix in the model dtype) on kiln.ops.linear (F.linear, i.e. cuBLAS, when x comes in another dtype),
the quantized checkpoint layouts (kiln.ops.gemm.quantized_layouts) on quantize_fp8 / quantize_int8 +
fp8_linear / int8_linear, int4_linear and fp8_block_linear. The CPU layouts (oneDNN blocks, torch's
int4 packing) cannot run here: prepare the weight for CUDA."""

from __future__ import annotations

import torch.nn.functional as F

from kiln.ops.gemm.gguf_linear import gguf_linear
from kiln.ops.gemm.gguf_planar import PLANAR_LAYOUTS
from kiln.ops.gemm.gguf_planar_triton import gguf_planar_linear_triton
from kiln.ops.gemm.linear import linear
from kiln.ops.gemm.prepared_linear.spec import PREPARED_LINEAR
from kiln.ops.gemm.quantized_layouts import QUANTIZED_LAYOUTS, run_quantized
from kiln.ops.gemm.weight_formats import GGUF_LAYOUTS
from kiln.ops.registry import Implementation


def prepared_linear_triton(x, layout, weight, bias=None, out_dtype=None):
    out_dtype = out_dtype or x.dtype
    qtype = PLANAR_LAYOUTS.get(layout)
    if qtype is not None:
        return gguf_planar_linear_triton(x, weight, qtype, bias).to(out_dtype)
    qtype = GGUF_LAYOUTS.get(layout)
    if qtype is not None:
        return gguf_linear(x, weight[0], qtype, bias).to(out_dtype)
    if layout in QUANTIZED_LAYOUTS:
        return run_quantized(x, layout, weight, bias, out_dtype)
    if layout != "dense":
        raise ValueError(
            f"prepared_linear: layout {layout!r} is a CPU layout; prepare the weight for {x.device}"
        )
    matrix = weight[0]
    if matrix.dtype != x.dtype:
        return F.linear(x.to(matrix.dtype), matrix, bias).to(out_dtype)
    return linear(x, matrix, bias).to(out_dtype)


def _cuda(device) -> bool:
    return device is not None and device.type == "cuda"


PREPARED_LINEAR.register(
    Implementation("triton", prepared_linear_triton, _cuda,
                   description="gguf_planar_* -> its planar GEMM, gguf_* -> gguf_linear, dense -> linear")
)  # fmt: skip
