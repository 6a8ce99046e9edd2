"""CPU prepared_linear: one kernel per layout (kiln.ops.gemm.weight_formats packs the weights).

  "onednn"       oneDNN's prepacked linear (as weight_formats.onednn_linear) in the packed dtype (fp32:
                 MKL sgemm's arithmetic, 3-4x faster at decode sizes; bf16: x and output in bf16);
  "fp16_onednn"  one row: PyTorch's fp16 GEMV (x rounded to fp16; reads half the bytes of fp32);
                 several rows: the packed float32 copy of the same fp16 values;
  "fp16_rows"    the same without oneDNN: several rows through F.linear on the float32 copy;
  "int4"         PyTorch's weight-packed int4 CPU matmul, group size 32, bfloat16 activations (its
                 fast path); the bias is added in float32;
  "int4_onednn"  one row: as "int4"; several rows: oneDNN's bf16 GEMM on the copy of the same matrix;
  "q4_blocks_onednn"  one row: q4_blocks_gemv (float32 on GGUF Q4 blocks' values, d and m, exact);
                 native_cpu.blocks_tiles_rows("q4") rows (batched decode; AVX-512 builds: 8 to 32,
                 64 without the panel kernel): q4_tiles_gemm on their 16-row tiles; other rows up
                 to native_cpu.blocks_gemm_rows() (32 on AVX2 and AVX-512 builds, else 1):
                 q4_blocks_gemm on the same blocks; more: blocks_panel_gemm on the blocks (vector
                 builds: the layout keeps no float32 copy), else oneDNN's fp32 GEMM on the copy;
  "q8_blocks_onednn"  one row: int8_blocks_gemv (float32 on GGUF Q8_0's values and scales, exact;
                 Kiln's native kernel); a few rows: q8_tiles_gemm for blocks_tiles_rows("q8") rows
                 (AVX-512: 16 to 32), else q8_blocks_gemm (as the Q4 layout above); more: as the Q4
                 layout (blocks_panel_gemm, or oneDNN's fp32 GEMM on the copy);
  "q4_blocks_a8_onednn", "q8_blocks_a8_onednn", "q8_blocks_mins_a8_onednn"  one row: x quantized to
                 Q8_0, then Kiln's integer GEMV on the same blocks (kiln.ops.gemm.cpu_blocks_a8; the
                 mins times x' summed over their blocks); several rows: as the exact layouts (the tile
                 and row kernels included);
  "kquants_a8"   a K-quant weight's file blocks: every row of x quantized to Q8_K, then the integer
                 kernel on the blocks (kiln.ops.gemm.cpu_kquants_a8; each row's outputs whatever the
                 rows beside it);
  "kquants"      the same tensors, exact (x as is, each weight its float32 value): up to
                 cpu_kquants.rows_kernel_max() rows kquants_gemm, more kquants_panel_gemm
                 (kiln.ops.gemm.cpu_kquants);
  "q8_blocks_mins_onednn"  GGUF Q5_K (and a stacked weight of mixed GGUF types, a scale and a min per 16
                 or 32): as "q8_blocks_onednn" without tiles, the Q8 kernels given the
                 blocks' mins too (one row: each block's sum of x times its min added; a few rows: each
                 block decoded as fma(q, d * sc, min); exact); more rows: as the Q4 layout;
  "int8_blocks_onednn"  one row: as "q8_blocks_onednn"; several rows: oneDNN's bf16 GEMM on the copy;
  "w8a8_packed"  kiln.ops.gemm.cpu_w8a8: x * smooth quantized to int8 per row, Kiln's AMX tile kernel
                 or oneDNN's int8 GEMM (one native op);
  "int4_w8a8_packed", "int8_blocks_w8a8_packed", "q4_blocks_w8a8_packed"  one row (q4_blocks_w8a8:
                 up to weight_formats.exact_rows, the row kernel beyond one) as "int4" /
                 "int8_blocks_onednn" / "q4_blocks_onednn"; more rows: W8A8 on the int8 copy;
  "int8_weight"  PyTorch's weight-only int8 CPU matmul (per-channel bf16 scales, bfloat16
                 activations and output) at every row count, so a row's values do not depend on the
                 rows beside it; the bias is added in float32;
  "dense"        F.linear in the matrix's dtype;
  "gguf_*"       kiln.ops.gguf_linear (the "gguf" format's blocks, decoded every call);
  "gguf_planar_*"  CUDA's GGUF layout, here for completeness: F.linear on the decoded float32 matrix;
  quantized checkpoint layouts (kiln.ops.gemm.quantized_layouts.run_quantized): W8A8 quantizes x
                 (quantize_fp8 / quantize_int8) and multiplies by the float32 copy of the weight's
                 values; "w4a16_*" and "fp8_block*" run int4_linear's / fp8_block_linear's CPU paths.
Each converts x only where the layout computes in another dtype, and the result to out_dtype (no
copy when the dtypes already agree).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.cpu_block_tiles import q4_tiles_gemm, q8_tiles_gemm
from kiln.ops.gemm.cpu_blocks_a8 import q4_blocks_a8_gemv, q8_blocks_a8_gemv, q8_blocks_mins_a8_gemv
from kiln.ops.gemm.cpu_blocks_panel import blocks_panel_gemm
from kiln.ops.gemm.cpu_kquants import kquants_matmul
from kiln.ops.gemm.cpu_kquants_a8 import kquants_a8_gemm
from kiln.ops.gemm.cpu_q4_blocks import q4_blocks_gemm, q4_blocks_gemv
from kiln.ops.gemm.cpu_q8_blocks import q8_blocks_gemm
from kiln.ops.gemm.cpu_w8a8 import w8a8_linear
from kiln.ops.gemm.gguf_linear import gguf_linear
from kiln.ops.gemm.gguf_planar import PLANAR_LAYOUTS, planar_matrix
from kiln.ops.gemm.prepared_linear.int8_blocks_gemv import int8_blocks_gemv
from kiln.ops.gemm.prepared_linear.spec import PREPARED_LINEAR
from kiln.ops.gemm.quantized_layouts import QUANTIZED_LAYOUTS, run_quantized
from kiln.ops.gemm.weight_formats import GGUF_LAYOUTS, INT4_GROUP_SIZE, exact_rows
from kiln.ops.native_cpu import blocks_gemm_rows, blocks_tiles_take
from kiln.ops.registry import Implementation, cpu_only

# Each kernel is flat (no helper calls; the W8A8 hybrids below add one): the engine makes ~120 of these
# calls per decode step.


def _as(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return bias if bias is None or bias.dtype == dtype else bias.to(dtype)


def _dense(x, weight, bias, out_dtype):
    matrix = weight[0]
    return F.linear(x.to(matrix.dtype), matrix, bias).to(out_dtype)


def _onednn(x, weight, bias, out_dtype):
    packed = weight[0]
    x = x.to(packed.dtype).contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed, _as(bias, packed.dtype), "none", [], "").to(
        out_dtype
    )


def _fp16_onednn(x, weight, bias, out_dtype):
    if x.shape[0] > 1:
        packed = weight[1]
        x = x.to(packed.dtype).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x, packed, _as(bias, packed.dtype), "none", [], "")
        return y.to(out_dtype)
    matrix = weight[0]
    return F.linear(x.to(matrix.dtype), matrix, bias).to(out_dtype)


def _fp16_rows(x, weight, bias, out_dtype):
    if x.shape[0] > 1:
        return F.linear(x.float(), weight[1], _as(bias, torch.float32)).to(out_dtype)
    matrix = weight[0]
    return F.linear(x.to(matrix.dtype), matrix, bias).to(out_dtype)


def _int4(x, weight, bias, out_dtype):
    packed, scales_and_zeros = weight
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), packed, INT4_GROUP_SIZE, scales_and_zeros
    )
    if bias is not None:
        y = y.float().add_(bias)
    return y.to(out_dtype)


def _int4_onednn(x, weight, bias, out_dtype):
    x = x.to(torch.bfloat16)
    if x.shape[0] > 1:
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight[2], None, "none", [], "")
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight[0], INT4_GROUP_SIZE, weight[1])
    if bias is not None:
        y = y.float().add_(bias)
    return y.to(out_dtype)


def _int8_weight(x, weight, bias, out_dtype):
    values, scales = weight
    y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), values, scales)
    if bias is not None:
        y = y.float().add_(bias)
    return y.to(out_dtype)


def _int8_blocks_onednn(x, weight, bias, out_dtype):
    if x.shape[0] != 1:
        x = x.to(torch.bfloat16).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x, weight[2], None, "none", [], "")
    else:
        y = int8_blocks_gemv(x, weight[0], weight[1])
    if bias is not None:
        y = y.float().add_(bias)
    return y.to(out_dtype)


def _blocks_kernel(gemv, copy_at: int, gemm, tiles_gemm=None, kind: str = "q8"):
    """The "q4/q8_blocks[_a8]_onednn" kernels (and "q8_blocks_mins_onednn"'s): one row through `gemv`
    on the first `copy_at` tensors (the blocks' values and scales: 3 for Q4 and for Q5_K's with mins, 2
    for Q8_0); blocks_tiles_rows(kind) rows through `tiles_gemm` on the tiles after the
    float32 copy, where the layout has them; up to blocks_gemm_rows() rows through `gemm` on the
    blocks; more rows through blocks_panel_gemm on the blocks where the layout keeps no float32 copy
    (native_cpu.blocks_panel_runs()), else through the copy, as "onednn"."""

    def run(x, weight, bias, out_dtype):
        rows = x.shape[0]
        if rows == 1:
            y = gemv(x, *weight[:copy_at])
        elif tiles_gemm is not None and blocks_tiles_take(kind, rows) and weight[copy_at + 1].numel():
            y = tiles_gemm(x, weight[copy_at + 1], weight[copy_at + 2], weight[0].shape[0])
        elif rows <= blocks_gemm_rows():
            y = gemm(x, *weight[:copy_at])
        elif weight[copy_at].numel() == 0:  # no float32 copy: the panel kernel on the blocks
            y = blocks_panel_gemm(x, *weight[:copy_at])
        else:
            return _onednn(x, weight[copy_at:], bias, out_dtype)
        if bias is not None:
            y = y.add_(bias.float())
        return y.to(out_dtype)

    return run


_q4_blocks_onednn = _blocks_kernel(q4_blocks_gemv, 3, q4_blocks_gemm, q4_tiles_gemm, "q4")


def _kquant_kernel(matmul):
    """A KQUANT_LAYOUTS layout's kernel: `matmul` (x, blocks, parts, n) on its tensors, then the bias."""

    def run(x, weight, bias, out_dtype):
        y = matmul(x, weight[0], weight[1], weight[2].shape[0])
        if bias is not None:
            y = y.add_(bias.float())
        return y.to(out_dtype)

    return run


_kquants_a8 = _kquant_kernel(kquants_a8_gemm)


def _w8a8(x, weight, bias, out_dtype):
    return w8a8_linear(x, weight[0], weight[1], weight[2], weight[3], bias, out_dtype)


# The hybrids hand each call to the kernel of the layout whose tensors it reads: "int4" / the one-row
# branch of "int8_blocks_onednn" or "q4_blocks_onednn" (which read only the blocks) / "w8a8_packed".


def _int4_w8a8(x, weight, bias, out_dtype):
    if x.shape[0] > 1:
        return _w8a8(x, weight[2:], bias, out_dtype)
    return _int4(x, weight[:2], bias, out_dtype)


def _int8_blocks_w8a8(x, weight, bias, out_dtype):
    if x.shape[0] != 1:
        return _w8a8(x, weight[2:], bias, out_dtype)
    return _int8_blocks_onednn(x, weight[:2], bias, out_dtype)


def _q4_blocks_w8a8(x, weight, bias, out_dtype):
    if x.shape[0] > exact_rows("q4_blocks_w8a8_packed", weight):
        return _w8a8(x, weight[3:], bias, out_dtype)
    return _q4_blocks_onednn(x, weight[:3], bias, out_dtype)  # one row: the GEMV; more: the row kernel


def _gguf(qtype):
    def run(x, weight, bias, out_dtype):
        return gguf_linear(x, weight[0], qtype, bias).to(out_dtype)

    return run


def _gguf_planar(qtype):
    def run(x, weight, bias, out_dtype):
        return F.linear(x, planar_matrix(weight, qtype, torch.float32).to(x.dtype), bias).to(out_dtype)

    return run


KERNELS = {
    "dense": _dense,
    "onednn": _onednn,
    "fp16_onednn": _fp16_onednn,
    "fp16_rows": _fp16_rows,
    "int4": _int4,
    "int4_onednn": _int4_onednn,
    "int8_weight": _int8_weight,
    "int8_blocks_onednn": _int8_blocks_onednn,
    "q4_blocks_onednn": _q4_blocks_onednn,
    "q8_blocks_onednn": _blocks_kernel(int8_blocks_gemv, 2, q8_blocks_gemm, q8_tiles_gemm),
    # Q5_K's values, scales and mins: the Q8 kernels given the mins; no tiles
    "q8_blocks_mins_onednn": _blocks_kernel(int8_blocks_gemv, 3, q8_blocks_gemm),
    "q4_blocks_a8_onednn": _blocks_kernel(q4_blocks_a8_gemv, 3, q4_blocks_gemm, q4_tiles_gemm, "q4"),
    "q8_blocks_a8_onednn": _blocks_kernel(q8_blocks_a8_gemv, 2, q8_blocks_gemm, q8_tiles_gemm),
    "q8_blocks_mins_a8_onednn": _blocks_kernel(q8_blocks_mins_a8_gemv, 3, q8_blocks_gemm),
    "kquants_a8": _kquants_a8,
    "kquants": _kquant_kernel(kquants_matmul),
    "w8a8_packed": _w8a8,
    "int4_w8a8_packed": _int4_w8a8,
    "int8_blocks_w8a8_packed": _int8_blocks_w8a8,
    "q4_blocks_w8a8_packed": _q4_blocks_w8a8,
    **{layout: _gguf(qtype) for layout, qtype in GGUF_LAYOUTS.items()},
    **{layout: _gguf_planar(qtype) for layout, qtype in PLANAR_LAYOUTS.items()},
    **dict.fromkeys(QUANTIZED_LAYOUTS, run_quantized),
}


def prepared_linear_cpu(x, layout, weight, bias=None, out_dtype=None):
    kernel = KERNELS[layout]
    if kernel is run_quantized:
        return run_quantized(x, layout, weight, bias, out_dtype or x.dtype)
    return kernel(x, weight, bias, out_dtype or x.dtype)


PREPARED_LINEAR.register(
    Implementation("cpu", prepared_linear_cpu, cpu_only,
                   description="oneDNN fp32/bf16, fp16 GEMV + packed fp32 copy, int4 (+ bf16 / int8), int8, "
                               "Q4 / Q8_0 blocks, W8A8")
)  # fmt: skip
