"""prepared_linear: y = x @ W^T (+ bias) with W packed once, at load, for the device that runs it
(kiln.ops.gemm.weight_formats: the layouts, `prepare_linear_weight`). The model's Linear layers call
it on every step, so `kiln verify` / `kiln bench` check and time the engine's own path.

    x:         [M, K] float32 / float16 / bfloat16
    layout:    a PreparedLinearWeight's layout ("dense", "onednn", "fp16_onednn", "fp16_rows", "int4",
               "int4_onednn", "int4_w8a8_packed", "w8a8_packed", "int8_weight", "int8_blocks_onednn",
               "int8_blocks_w8a8_packed", "q4_blocks_onednn", "q8_blocks_onednn", "q4_blocks_a8_onednn",
               "q8_blocks_a8_onednn", "q8_blocks_mins_a8_onednn", "kquants_a8", "kquants",
               "q4_blocks_w8a8_packed", "gguf_<qtype>" for
               the GGUF block types of kiln.ops.gguf_linear, "gguf_planar_<qtype>" (CUDA: the same
               blocks in planes, kiln.ops.gemm.gguf_planar); the quantized checkpoint layouts of
               kiln.ops.gemm.quantized_layouts: "fp8_dynamic", "fp8_static", "int8_dynamic",
               "int8_static", "w4a16_g<gs>[_perm]", "fp8_block<bn>x<bk>")
    weight:    its tensors (PreparedLinearWeight.tensors), W standing for [N, K]
    bias:      [N] in the layout's bias dtype (PreparedLinearWeight.bias_dtype), or None
    out_dtype: the result's dtype (None: x's)
    y = x @ W^T + bias, [M, N]. Where the layout computes in a narrower dtype (its compute_dtype: fp16
    for one-row "fp16_*" inputs, bf16 for "int4" and bf16 "onednn"), x is rounded to it first.
    The W8A8 and block-FP8 layouts quantize x as their checkpoint format says (the reference does too);
    the "*w8a8_packed" layouts quantize x to int8 per row (all calls of "w8a8_packed", several-row
    calls of the others) and multiply by their int8 copy; the reference does the same in float64.
    The "*_a8_onednn" layouts quantize a one-row x to Q8_0 blocks (kiln.ops.gemm.cpu_blocks_a8); the
    reference reads x through gguf's own Q8_0 quantizer (cpu_blocks_a8.q8_0_reference). "kquants_a8"
    (a K-quant weight's file blocks) quantizes every row of x to Q8_K (kiln.ops.gemm.cpu_kquants_a8);
    the reference reads x through gguf's rounding per 256 values (cpu_kquants_a8.q8_k_reference).
    "kquants" (the same blocks, kiln.ops.gemm.cpu_kquants) is exact: x as is.
"""

from __future__ import annotations

import weakref

import torch

from kiln.ops import native_cpu
from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of, row_count
from kiln.ops.gemm import cpu_blocks_a8, cpu_kquants_a8, cpu_w8a8
from kiln.ops.gemm.cpu_q8_blocks import MIN_QTYPES
from kiln.ops.gemm.dense_baseline import bf16_matmul
from kiln.ops.gemm.gguf_blocks import make_gguf_weight, packed_bytes, validate_gguf_weight
from kiln.ops.gemm.gguf_linear import gguf_linear
from kiln.ops.gemm.gguf_linear.spec import QUANT_QTYPES
from kiln.ops.gemm.gguf_planar import PLANAR_LAYOUTS, planar_dtypes, planar_shapes
from kiln.ops.gemm.quantized_layouts import (
    FP8_BLOCK_LAYOUTS,
    QDTYPES,
    QUANTIZED_LAYOUTS,
    SPARSE24_LAYOUTS,
    W4A16_LAYOUTS,
    W8A8_LAYOUTS,
    fp8_block_layout,
    quantized_reference_input,
    sparse24_layout,
    w4a16_layout,
    w8a8_layout,
)
from kiln.ops.gemm.shapes import GEMM_TOLERANCE, SMOLLM2_135M, gemm_flops, quant_shapes
from kiln.ops.gemm.weight_formats import (
    A8_BLOCKS_FORMAT,
    A8_FORMATS,
    BLOCKS_FORMATS,
    EXACT_BLOCKS_FORMAT,
    EXACT_FORMATS,
    GGUF_LAYOUTS,
    INT4_GROUP_SIZE,
    INT4_QTYPES,
    INT8_BLOCK_SIZE,
    INT8_K_MULTIPLE,
    KQUANT_LAYOUTS,
    LAYOUTS,
    Q4_W8A8_EXACT_ROWS,
    W8A8_COPY_AT,
    W8A8_FALLBACK,
    exact_rows,
    kquants_layout_runs,
    onednn_packs_bf16,
    prepare_linear_weight,
    prepared_case,
    prepared_matrix,
    w8a8_matrix,
)
from kiln.ops.registry import BaselineNotApplicable, OpSpec, define_op
from kiln.ops.testing import clone_inputs, element_size, randn
from kiln.quant.gguf_blocks import (
    BLOCK_WEIGHTS,
    K_QUANTS,
    QK_K,
    WITH_MINS,
    GGUFStackedWeight,
    GGUFWeight,
    row_bytes,
    scale_group,
)
from kiln.quant.int4 import quantize_int4
from kiln.quant.linear_weights import BlockFP8Weight, Int4Weight, ScaledWeight
from kiln.quant.scaled import quantize_fp8_per_channel, quantize_int8_per_channel
from kiln.quant.sparse24 import Sparse24Weight, compress_24, prune_24


def prepared_linear_reference(x, layout, weight, bias=None, out_dtype=None):
    """In float64 from the matrix the prepared weight stands for (float64 x stays float64: the
    verifier's reference; otherwise the result is rounded to out_dtype / x's dtype once)."""
    if layout in W8A8_COPY_AT and x.shape[0] > exact_rows(layout, weight):
        smooth = weight[W8A8_COPY_AT[layout] + 3]
        matrix, xq = w8a8_matrix(layout, weight), cpu_w8a8.quantize_rows_reference(x, smooth)
    else:
        matrix = prepared_matrix(layout, weight, x.shape[-1]).to(x.device)
        if layout in QUANTIZED_LAYOUTS:
            xq = quantized_reference_input(layout, weight, x)
        elif layout == "kquants_a8":  # every row quantized to Q8_K
            xq = cpu_kquants_a8.q8_k_reference(x)
        elif layout in A8_LAYOUTS and x.shape[0] == 1:
            xq = cpu_blocks_a8.q8_0_reference(x)
        else:
            xq = x.to(torch.float64)
    y = xq @ matrix.T
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y if x.dtype == torch.float64 else y.to(out_dtype or x.dtype)


# one-row x quantized to Q8_0
A8_LAYOUTS = ("q4_blocks_a8_onednn", "q8_blocks_a8_onednn", "q8_blocks_mins_a8_onednn")


def _validate_kquants(op, layout, weight, k: int, device) -> None:
    """The "kquants_a8" / "kquants" layouts: a K-quant weight's file blocks, uint8 [bytes], its parts
    (GGML type id, rows) int64 [P, 2] (kiln.ops.gemm.cpu_kquants_a8.pack) and uint8 [N, 0], N the parts'
    rows."""
    blocks, parts, width = weight
    check_tensor(op, "weight[0]", blocks, ndim=1, dtypes=(torch.uint8,), device=device)
    check_tensor(op, "weight[1]", parts, ndim=2, dtypes=(torch.int64,), device=device)
    check_tensor(op, "weight[2]", width, ndim=2, dtypes=(torch.uint8,), device=device)
    n = width.shape[0]
    if torch.compiler.is_compiling():
        return  # (the table's values: not while tracing; the native op checks them again when it runs)
    qtypes = cpu_kquants_a8.QTYPES_BY_ID
    if parts.shape[1] != 2 or parts.shape[0] == 0 or any(t not in qtypes for t in parts[:, 0].tolist()):
        raise ValueError(
            f"{op}: {layout} K-quant parts {parts.tolist()}, expected rows (GGML type id, rows) with types "
            f"{cpu_kquants_a8.QTYPE_IDS}"
        )
    rows = int(parts[:, 1].sum())
    if rows != n or width.shape[1]:
        raise ValueError(
            f"{op}: {layout} parts hold {rows} rows, weight[2] is {list(width.shape)}, expected [{rows}, 0]"
        )
    per_super = cpu_kquants_a8.super_bytes(parts)  # bytes per 256 in-features
    if per_super == 0 or blocks.numel() % per_super:
        raise ValueError(
            f"{op}: {layout} K-quant blocks of {blocks.numel()} bytes in parts of {rows} rows, expected a "
            f"multiple of {per_super} (their bytes per {QK_K} in-features)"
        )
    if blocks.numel() // per_super * QK_K != k:
        raise ValueError(
            f"{op}: x has {k} in-features, the {layout!r} weight {blocks.numel() // per_super * QK_K}"
        )


def _in_features(layout: str, weight) -> int | None:
    if layout in ("int4", "int4_onednn", "int4_w8a8_packed"):
        return weight[1].shape[0] * INT4_GROUP_SIZE  # scales_and_zeros [K / 32, N, 2]
    if layout == "w8a8_packed":
        return weight[3].shape[0]  # smooth [K]
    if (
        layout in GGUF_LAYOUTS
        or layout in W4A16_LAYOUTS
        or layout in PLANAR_LAYOUTS
        or layout in KQUANT_LAYOUTS
    ):
        return None  # validate_gguf_weight, _validate_w4a16, _validate_kquants check them against x
    if layout in SPARSE24_LAYOUTS or layout in (
        "q4_blocks_onednn",
        "q4_blocks_a8_onednn",
        "q4_blocks_w8a8_packed",
    ):
        return 2 * weight[0].shape[1]  # values / nibbles [N, K/2]
    return weight[0].shape[1]


def _validate_quantized(op, layout, weight, K, device) -> None:
    """Shapes and dtypes of the quantized checkpoint layouts (kiln.ops.gemm.quantized_layouts)."""
    n = weight[0].shape[0]
    if layout in W8A8_LAYOUTS:
        qdtype = QDTYPES[W8A8_LAYOUTS[layout][0]]
        check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=(qdtype, torch.float32), device=device)
        check_tensor(op, "weight[1]", weight[1], ndim=2, dtypes=(torch.float32,), device=device)
        if tuple(weight[1].shape) != (n, 1):
            raise ValueError(f"{op}: {layout} w_scale has shape {tuple(weight[1].shape)}, expected ({n}, 1)")
        if len(weight) == 3:
            check_tensor(op, "weight[2]", weight[2], ndim=1, dtypes=(torch.float32,), device=device)
            if weight[2].shape[0] != 1:
                raise ValueError(f"{op}: {layout} x_scale has {weight[2].shape[0]} elements, expected 1")
    elif layout in W4A16_LAYOUTS:
        group_size, permuted = W4A16_LAYOUTS[layout]
        check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=(torch.int32,), device=device)
        check_tensor(
            op, "weight[1]", weight[1], ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,), device=device
        )
        check_tensor(op, "weight[2]", weight[2], ndim=2, dtypes=(torch.uint8,), device=device)
        words, groups = -(-K // 8), -(-K // group_size)
        for name, t, cols in (
            ("qweight", weight[0], words),
            ("scales", weight[1], groups),
            ("zeros", weight[2], groups),
        ):
            if tuple(t.shape) != (n, cols):
                raise ValueError(
                    f"{op}: {layout} {name} has shape {tuple(t.shape)}, expected ({n}, {cols}) for K={K}"
                )
        if permuted:
            check_tensor(op, "weight[3]", weight[3], ndim=1, dtypes=(torch.int64,), device=device)
            if weight[3].shape[0] != K:
                raise ValueError(f"{op}: {layout} perm has {weight[3].shape[0]} elements, expected K={K}")
    elif layout in SPARSE24_LAYOUTS:
        check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=FLOAT_DTYPES, device=device)
        check_tensor(op, "weight[1]", weight[1], ndim=2, dtypes=(torch.uint8,), device=device)
        if tuple(weight[1].shape) != (n, -(-K // 8)):
            raise ValueError(
                f"{op}: sparse24 meta has shape {tuple(weight[1].shape)}, expected ({n}, {-(-K // 8)})"
            )
        if layout == "sparse24_semi":
            if tuple(weight[2].shape) != (n, K) or weight[2].device != weight[0].device:
                raise ValueError(
                    f"{op}: sparse24_semi weight[2] is {tuple(weight[2].shape)} on {weight[2].device}, "
                    f"expected the semi-structured [{n}, {K}] on {weight[0].device}"
                )
            cpu = torch.device("cpu")
            check_tensor(op, "weight[3]", weight[3], ndim=0, dtypes=(torch.int64,), device=cpu)
    else:
        bn, bk = FP8_BLOCK_LAYOUTS[layout]
        w_dtypes = (torch.float8_e4m3fn, torch.float32)  # float32: the CPU's dequantized copy
        check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=w_dtypes, device=device)
        check_tensor(op, "weight[1]", weight[1], ndim=2, dtypes=(torch.float32,), device=device)
        if weight[0].shape[1] != K:
            raise ValueError(f"{op}: x has {K} in-features, the {layout!r} weight {weight[0].shape[1]}")
        expected = (-(-n // bn), -(-K // bk))
        if tuple(weight[1].shape) != expected:
            raise ValueError(f"{op}: {layout} scale has shape {tuple(weight[1].shape)}, expected {expected}")


def _validate_planar(op, layout, weight, K, device) -> None:
    """The planes (qs, qh, scales, mins, supers) of kiln.ops.gemm.gguf_planar for an [N, K] weight."""
    qtype = PLANAR_LAYOUTS[layout]
    if K % BLOCK_WEIGHTS[qtype]:
        raise ValueError(f"{op}: K={K} must be a multiple of {BLOCK_WEIGHTS[qtype]} (the GGUF {qtype} block)")
    n = weight[0].shape[0] if weight[0].dim() == 2 else -1
    for i, (name, tensor, dtype, expected) in enumerate(
        zip(
            ("qs", "qh", "scales", "mins", "supers"),
            weight,
            planar_dtypes(qtype),
            planar_shapes(n, K, qtype),
            strict=True,
        )
    ):
        check_tensor(op, f"weight[{i}]", tensor, ndim=2, dtypes=(dtype,), device=device)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{op}: {layout} weight[{i}] ({name}) has shape {tuple(tensor.shape)}, expected {expected} "
                f"for K={K}"
            )


def _validate_tiles(op, layout, weight, n: int, k: int, device) -> None:
    """The last two tensors of a Q4 / Q8_0 blocks layout: its 16-row tiles and their scales
    (kiln.ops.gemm.cpu_block_tiles.layout_tiles), or both empty where this build runs no tile kernel."""
    at = len(weight) - 2
    tiles, scales = weight[at], weight[at + 1]
    q4 = layout.startswith("q4")
    tiles_dtype = torch.uint8 if q4 else torch.int8
    scales_dtypes = (torch.float32, torch.float16) if q4 else (torch.float32,)  # Q4: float16 where exact
    check_tensor(op, f"weight[{at}]", tiles, ndim=2, dtypes=(tiles_dtype,), device=device)
    check_tensor(op, f"weight[{at + 1}]", scales, ndim=2, dtypes=scales_dtypes, device=device)
    per16 = not q4 and weight[1].shape[1] * INT8_BLOCK_SIZE != k  # Q6_K's values: no tile kernel
    no_tiles_here = per16 or not native_cpu.blocks_tiles_rows("q4" if q4 else "q8")[0]
    if tiles.numel() == 0 and scales.numel() == 0 and no_tiles_here:
        return
    if per16:
        raise ValueError(f"{op}: {layout} with a scale per 16 values has no tiles, got {tuple(tiles.shape)}")
    num_tiles, groups = -(-n // 16), k // (INT4_GROUP_SIZE if q4 else INT8_BLOCK_SIZE)
    expected = (num_tiles, groups * 256 if q4 else k * 16), (num_tiles, groups * (32 if q4 else 16))
    if (tuple(tiles.shape), tuple(scales.shape)) != expected:
        raise ValueError(
            f"{op}: {layout} tiles {tuple(tiles.shape)} and tile scales {tuple(scales.shape)}, expected "
            f"{expected[0]} and {expected[1]} for an [{n}, {k}] weight (kiln.ops.gemm.cpu_block_tiles)"
        )


def _check_q8_0_blocks(op, layout, weight, device) -> tuple[int, int]:
    """Q8_0's int8 values [N, K] and float32 scales [N, K / 32] (weight[0], weight[1]; the q8_blocks
    layouts also scales [N, K / 16]: Q6_K's, a stacked weight's) -> (N, K)."""
    check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=(torch.int8,), device=device)
    check_tensor(op, "weight[1]", weight[1], ndim=2, dtypes=(torch.float32,), device=device)
    n, k = weight[0].shape
    per_16 = layout.startswith("q8_blocks")  # every q8_blocks layout; int8_blocks' are Q8_0's only
    blocks = (INT8_BLOCK_SIZE, scale_group("Q6_K")) if per_16 else (INT8_BLOCK_SIZE,)
    if not any(k % b == 0 and tuple(weight[1].shape) == (n, k // b) for b in blocks):
        expected = " or ".join(f"({n}, {k // b})" for b in blocks)  # a scale per 32 (or per 16)
        raise ValueError(
            f"{op}: {layout} values [{n}, {k}] and scales {tuple(weight[1].shape)}, expected "
            f"in-features a multiple of {blocks[-1]} and scales {expected}"
        )
    return n, k


def _check_q4_blocks(op, layout, weight, device) -> tuple[int, int]:
    """The Q4 blocks' nibbles uint8 [N, K / 2], d and m float32 [N, K / 32] (weight[0..2]) -> (N, K)."""
    check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=(torch.uint8,), device=device)
    check_tensor(op, "weight[1]", weight[1], ndim=2, dtypes=(torch.float32,), device=device)
    check_tensor(op, "weight[2]", weight[2], ndim=2, dtypes=(torch.float32,), device=device)
    n, k = weight[0].shape[0], 2 * weight[0].shape[1]
    groups = k // INT4_GROUP_SIZE
    if k % INT4_GROUP_SIZE or tuple(weight[1].shape) != (n, groups) or tuple(weight[2].shape) != (n, groups):
        raise ValueError(
            f"{op}: {layout} nibbles [{n}, {k // 2}], scales {tuple(weight[1].shape)} and mins "
            f"{tuple(weight[2].shape)}, expected in-features a multiple of {INT4_GROUP_SIZE} and "
            f"scales and mins ({n}, {groups})"
        )
    return n, k


def _check_copy(op, layout, weight, at: int, n: int, k: int, dtype, device) -> None:
    """weight[at]: a blocks layout's oneDNN-packed copy of the [n, k] matrix, in `dtype`; a float32
    one is empty where the blocks run every row count here (native_cpu.blocks_panel_runs())."""
    check_tensor(op, f"weight[{at}]", weight[at], ndim=2, dtypes=(dtype,), device=device)
    if dtype == torch.float32 and weight[at].numel() == 0:
        if native_cpu.blocks_panel_runs():
            return
        raise ValueError(
            f"{op}: {layout} holds no float32 copy, which its many-row calls need on this build (Kiln's "
            "native CPU library is not loaded or has no vector kernels): prepare the weight here"
        )
    if tuple(weight[at].shape) != (n, k):  # oneDNN's packing of the copy reports the matrix's shape
        raise ValueError(f"{op}: {layout} copy has shape {tuple(weight[at].shape)}, expected {n, k}")


def _validate_q8_blocks(op, layout, weight, device) -> None:
    """The layouts "int8_blocks_onednn" (a bf16 copy) and "q8_blocks[_a8]_onednn" (a float32 copy, then
    the tiles)."""
    copy_dtype = torch.bfloat16 if layout == "int8_blocks_onednn" else torch.float32
    n, k = _check_q8_0_blocks(op, layout, weight, device)
    _check_copy(op, layout, weight, 2, n, k, copy_dtype, device)
    if layout != "int8_blocks_onednn":
        _validate_tiles(op, layout, weight, n, k, device)


def _validate_q8_blocks_mins(op, layout, weight, device) -> None:
    """Values int8 [N, K], scales and mins float32 [N, K / 32] (Q5_K's) or [N, K / 16] (a stacked
    weight's, kiln.quant.gguf_blocks.GGUFStackedWeight), then the float32 copy."""
    n, k = _check_q8_0_blocks(op, layout, weight, device)
    check_tensor(op, "weight[2]", weight[2], ndim=2, dtypes=(torch.float32,), device=device)
    if tuple(weight[2].shape) != tuple(weight[1].shape):
        raise ValueError(f"{op}: {layout} mins {tuple(weight[2].shape)}, expected {tuple(weight[1].shape)}")
    _check_copy(op, layout, weight, 3, n, k, torch.float32, device)


def _validate_q4_blocks(op, layout, weight, device) -> None:
    n, k = _check_q4_blocks(op, layout, weight, device)
    _check_copy(op, layout, weight, 3, n, k, torch.float32, device)
    _validate_tiles(op, layout, weight, n, k, device)


def _validate_w8a8(op, layout, weight, device) -> None:
    """The int8 copy of a W8A8 layout (W8A8_COPY_AT), and the int4 / Q8_0 tensors before it."""
    at = W8A8_COPY_AT[layout]
    if layout == "int4_w8a8_packed":
        check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=(torch.uint8,), device=device)
        check_tensor(op, "weight[1]", weight[1], ndim=3, dtypes=(torch.bfloat16,), device=device)
        expected = (weight[1].shape[0] * INT4_GROUP_SIZE, weight[1].shape[1])
    elif layout in ("int8_blocks_w8a8_packed", "q4_blocks_w8a8_packed"):  # the blocks for few rows
        check = _check_q8_0_blocks if layout == "int8_blocks_w8a8_packed" else _check_q4_blocks
        n, k = check(op, layout, weight, device)
        expected = (k, n)
    else:
        expected = None
    packed, w_scale, zero_point, smooth = weight[at : at + 4]
    check_tensor(op, f"weight[{at}]", packed, ndim=(2, 5), dtypes=(torch.int8,), device=device)
    check_tensor(op, f"weight[{at + 1}]", w_scale, ndim=1, dtypes=(torch.float32,), device=device)
    check_tensor(op, f"weight[{at + 2}]", zero_point, ndim=1, dtypes=(torch.int64,), device=device)
    check_tensor(op, f"weight[{at + 3}]", smooth, ndim=1, dtypes=(torch.float32,), device=device)
    k, n = smooth.shape[0], w_scale.shape[0]
    if expected is not None and (k, n) != expected:
        raise ValueError(
            f"{op}: {layout} int8 copy has scales for {n} out- and smooth for {k} in-features, expected "
            f"{expected[1]} and {expected[0]}"
        )
    if zero_point.shape[0] != n:
        raise ValueError(
            f"{op}: {layout} zero points {tuple(zero_point.shape)}, expected ({n},) as the scales"
        )
    if packed.dim() == 5:  # AMX tiles (kiln.ops.gemm.cpu_w8a8.to_tiles)
        tiles = cpu_w8a8.tiles_shape(n, k)
        if tuple(packed.shape) != tiles or not packed.is_contiguous():
            raise ValueError(
                f"{op}: {layout} AMX tiles {tuple(packed.shape)}, expected contiguous {tiles} ([{n}, {k}])"
            )
    elif tuple(packed.shape) != (k, n):
        raise ValueError(
            f"{op}: {layout} int8 copy reports {tuple(packed.shape)}, expected {(k, n)} ([K, N])"
        )


def validate_prepared_linear(x, layout, weight, bias, out_dtype) -> None:
    op = "prepared_linear"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: unknown layout {layout!r}, expected one of {', '.join(LAYOUTS)}")
    if len(weight) != LAYOUTS[layout]:
        raise ValueError(f"{op}: layout {layout!r} holds {LAYOUTS[layout]} tensors, got {len(weight)}")
    device = device_of(x)
    if layout in ("int4", "int4_onednn"):
        check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=(torch.uint8,), device=device)
        check_tensor(op, "weight[1]", weight[1], ndim=3, dtypes=(torch.bfloat16,), device=device)
        if layout == "int4_onednn":  # oneDNN's packing of the bf16 copy reports the matrix's shape
            check_tensor(op, "weight[2]", weight[2], ndim=2, dtypes=(torch.bfloat16,), device=device)
            expected = (weight[1].shape[1], weight[1].shape[0] * INT4_GROUP_SIZE)
            if tuple(weight[2].shape) != expected:
                raise ValueError(
                    f"{op}: int4_onednn copy has shape {tuple(weight[2].shape)}, expected {expected}"
                )
    elif layout in W8A8_COPY_AT:
        _validate_w8a8(op, layout, weight, device)
    elif layout == "int8_weight":
        check_tensor(op, "weight[0]", weight[0], ndim=2, dtypes=(torch.int8,), device=device)
        check_tensor(op, "weight[1]", weight[1], ndim=1, dtypes=(torch.bfloat16,), device=device)
        if weight[1].shape[0] != weight[0].shape[0]:
            raise ValueError(
                f"{op}: int8_weight scales have {weight[1].shape[0]} elements, expected {weight[0].shape[0]}"
            )
        if weight[0].shape[1] % INT8_K_MULTIPLE:
            raise ValueError(
                f"{op}: int8_weight in-features {weight[0].shape[1]} are not a multiple of "
                f"{INT8_K_MULTIPLE} (torch's int8 CPU matmul)"
            )
    elif layout in KQUANT_LAYOUTS:
        _validate_kquants(op, layout, weight, x.shape[-1], device)
    elif layout in ("int8_blocks_onednn", "q8_blocks_onednn", "q8_blocks_a8_onednn"):
        _validate_q8_blocks(op, layout, weight, device)
    elif layout in ("q4_blocks_onednn", "q4_blocks_a8_onednn"):
        _validate_q4_blocks(op, layout, weight, device)
    elif layout in ("q8_blocks_mins_onednn", "q8_blocks_mins_a8_onednn"):
        _validate_q8_blocks_mins(op, layout, weight, device)
    elif layout in GGUF_LAYOUTS:
        validate_gguf_weight(op, weight[0], GGUF_LAYOUTS[layout], x.shape[-1], device)
    elif layout in PLANAR_LAYOUTS:
        _validate_planar(op, layout, weight, x.shape[-1], device)
    elif layout in QUANTIZED_LAYOUTS:
        _validate_quantized(op, layout, weight, x.shape[-1], device)
    else:
        for i, tensor in enumerate(weight):
            check_tensor(op, f"weight[{i}]", tensor, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    in_features = _in_features(layout, weight)
    if in_features is not None and in_features != x.shape[-1]:
        raise ValueError(f"{op}: x has {x.shape[-1]} in-features, the {layout!r} weight {in_features}")
    if bias is not None:
        # F.linear adds a bias of the matrix's dtype, gguf_linear one of x's; the others convert it
        bias_dtypes = {"dense": weight[0].dtype, "fp16_onednn": torch.float16, "fp16_rows": torch.float16}
        gguf = layout in GGUF_LAYOUTS or layout in PLANAR_LAYOUTS
        expected = x.dtype if gguf else bias_dtypes.get(layout)
        check_tensor(
            op, "bias", bias, ndim=1, dtypes=(expected,) if expected else FLOAT_DTYPES, device=device
        )
        out_features = _out_features(layout, weight)
        if bias.shape[0] != out_features:
            raise ValueError(f"{op}: bias has {bias.shape[0]} elements, expected out-features {out_features}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: out_dtype {out_dtype}, expected one of float32, float16, bfloat16 or None")


def _out_features(layout, weight) -> int:
    if layout in KQUANT_LAYOUTS:
        return weight[2].shape[0]  # [N, 0]
    return weight[1].shape[0] if layout == "w8a8_packed" else weight[0].shape[0]  # w_scale: [N]


def _call_case(x, layout, weight, bias, out_dtype):
    """The case of a call: a checkpoint layout names its source; the CPU and GGUF layouts' format and
    source are what prepare_linear_weight made them from (None for tensors it did not prepare)."""
    N = _out_features(layout, weight)
    shape = {"M": row_count(x), "N": N, "K": x.shape[-1], "bias": bias is not None}
    if layout in QUANTIZED_LAYOUTS:
        source = "sparse24" if layout in SPARSE24_LAYOUTS else layout
        return {**shape, "format": "kernel", "source": source}, x.dtype
    case = prepared_case(weight)
    if case is None:
        return None
    return {**shape, "format": case[0], "source": case[1]}, x.dtype


def _fake(x, layout, weight, bias, out_dtype):
    return x.new_empty((x.shape[0], _out_features(layout, weight)), dtype=out_dtype or x.dtype)


# ---- inputs: a weight prepared as the engine prepares it, for the device it runs on ----------------
#
# A shape asks for what the loader asks for: "format" is the cpu_format, "source" the checkpoint
# weight ("float", or GGUF blocks "Q4_0" / "Q4_1" / "Q8_0" / "Q4_K" / ...). On the CPU that gives the
# CPU layouts; on CUDA the same shape gives "gguf_planar_*" (GGUF sources) or "dense" (float sources),
# as for the engine.

_BASELINE_MATRICES: dict[int, torch.Tensor] = {}  # id(weight[0]) -> its float32 matrix, while it lives
_GGUF_BLOCKS: dict[int, tuple] = {}  # id(weight[0]) -> (the GGUF blocks it was prepared from, qtype)


def _make_inputs(shape, dtype, device, generator):
    M, N, K = shape["M"], shape["N"], shape["K"]
    source = shape.get("source", "float")
    if source in _QUANTIZED_SOURCES:
        return _make_quantized_inputs(shape, dtype, device, generator)
    if source == "float":
        weight = randn((N, K), torch.float32, "cpu", generator, scale=K**-0.5)
    elif "+" in source:
        weight = _stacked_weight(source.split("+"), N, K, generator)
    else:
        blocks = make_gguf_weight({"N": N, "K": K, "qtype": source}, "cpu", generator)
        weight = GGUFWeight(source, blocks, (N, K))
    prepared = prepare_linear_weight(weight, device=device, dtype=dtype, cpu_format=shape["format"])
    matrix = weight if source == "float" else weight.dequantize(torch.float32)
    _remember_matrix(prepared.tensors[0], matrix.to(device))
    if isinstance(weight, GGUFWeight):
        _remember(_GGUF_BLOCKS, prepared.tensors[0], (blocks.to(device), source))
    return {
        "x": randn((M, K), dtype, device, generator),
        "layout": prepared.layout,
        "weight": list(prepared.tensors),
        "bias": randn((N,), prepared.bias_dtype, device, generator) if shape.get("bias") else None,
        "out_dtype": torch.float32 if shape.get("float32_out") else None,
    }


def _stacked_weight(qtypes: list[str], N: int, K: int, generator) -> GGUFStackedWeight:
    """A fused projection whose parts have GGUF types `qtypes` (source "Q4_K+Q6_K": a Q4_K_M file's
    QKV), N rows split among them as evenly as they go (each at least one)."""
    rows = [N // len(qtypes) + (i < N % len(qtypes)) for i in range(len(qtypes))]
    parts = [
        GGUFWeight(q, make_gguf_weight({"N": n, "K": K, "qtype": q}, "cpu", generator), (n, K))
        for q, n in zip(qtypes, rows, strict=True)
    ]
    return GGUFStackedWeight.stack(parts)


# Quantized checkpoint sources: the weight a checkpoint of that format holds (random values quantized
# by Kiln's own quantizers into that format), placed in its kernel layout on the device (format
# "kernel"; the loader's CPU choices for them are tested with the loaders).
_QUANTIZED_SOURCES = (
    "fp8_dynamic", "fp8_static", "int8_dynamic", "int8_static", "w4a16_g32", "w4a16_g128",
    "w4a16_g64_perm", "fp8_block128x128", "sparse24",
)  # fmt: skip


def _quantized_weight(source, N, K, generator):
    weight = randn((N, K), torch.float32, "cpu", generator, scale=K**-0.5)
    if source.startswith(("fp8_dynamic", "fp8_static", "int8_")):
        quantize = quantize_fp8_per_channel if source.startswith("fp8") else quantize_int8_per_channel
        data, scale = quantize(weight)
        input_scale = torch.tensor([4.0 / (448.0 if source.startswith("fp8") else 127.0)])
        return ScaledWeight(source.split("_")[0], data, scale, input_scale if "static" in source else None)
    if source.startswith("w4a16"):
        group_size, permuted = W4A16_LAYOUTS[source]
        qweight, scales, zeros = quantize_int4(weight, group_size)
        perm = torch.randperm(K, generator=generator) if permuted else None
        return Int4Weight(qweight, scales, zeros, group_size, K, perm)
    if source == "sparse24":
        return Sparse24Weight(*compress_24(prune_24(weight)))
    bn, bk = FP8_BLOCK_LAYOUTS[source]
    scale = 0.5 + torch.rand((-(-N // bn), -(-K // bk)), generator=generator)
    data = randn((N, K), torch.float32, "cpu", generator, scale=40.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    return BlockFP8Weight(data, scale * K**-0.5 / 40.0, (bn, bk))


def _make_quantized_inputs(shape, dtype, device, generator):
    M, N, K, source = shape["M"], shape["N"], shape["K"], shape["source"]
    weight = _quantized_weight(source, N, K, generator)
    if isinstance(weight, ScaledWeight):
        layout, tensors = w8a8_layout(weight, device)
    elif isinstance(weight, Int4Weight):
        layout, tensors = w4a16_layout(weight, device)
    elif isinstance(weight, Sparse24Weight):
        layout, tensors = sparse24_layout(weight, device, dtype)
    else:
        layout, tensors = fp8_block_layout(weight, device)
    _remember_matrix(tensors[0], weight.dequantize(torch.float32).to(device))
    return {
        "x": randn((M, K), dtype, device, generator),
        "layout": layout,
        "weight": list(tensors),
        "bias": randn((N,), dtype, device, generator) if shape.get("bias") else None,
        "out_dtype": torch.float32 if shape.get("float32_out") else None,
    }


def _copy_inputs(inputs: dict) -> dict:
    """A bench copy of an input set: the tensors cloned (quantizing a Llama-3-8B weight on the host for
    each L2-flushing copy took seconds), the baselines' float matrix and GGUF blocks cloned with them."""
    copy = clone_inputs(inputs)
    key, new = inputs["weight"][0], copy["weight"][0]
    if id(key) in _BASELINE_MATRICES:
        _remember_matrix(new, _BASELINE_MATRICES[id(key)].clone())
    if id(key) in _GGUF_BLOCKS:
        blocks, qtype = _GGUF_BLOCKS[id(key)]
        _remember(_GGUF_BLOCKS, new, (blocks.clone(), qtype))
    return copy


def _remember_matrix(key: torch.Tensor, matrix: torch.Tensor) -> None:
    _remember(_BASELINE_MATRICES, key, matrix)


def _remember(table: dict, key: torch.Tensor, value) -> None:
    table[id(key)] = value
    weakref.finalize(key, table.pop, id(key), None)


# (format, source) pairs: every CPU layout (fp16 one-row and multi-row; bf16 "onednn" where this CPU
# packs bf16, else "dense"; int4 from the three Q4 types), GGUF sources kept dense on the CPU or as
# blocks ("gguf"), "gguf_*" and "dense" on CUDA.
_FUZZ_FORMATS = (
    ("fp32", "float"),
    ("fp16", "float"),
    ("bf16", "float"),
    ("int4", "Q4_0"),
    ("int4", "Q4_1"),
    ("fp16", "Q8_0"),
    ("fp32", "Q4_1"),
    ("int4", "Q4_K"),
    ("int4_bf16", "Q4_1"),  # "int4_onednn" where this CPU packs bf16, else "int4"
    ("int8", "float"),  # in-features a multiple of 16: "int8_weight"
    ("int8", "float"),  # any in-features: mostly the "fp16" layouts it falls back to
    ("int8", "Q4_1"),
    ("int8_blocks", "Q8_0"),  # "int8_blocks_onednn" where this CPU packs bf16, else "onednn" / "dense"
    ("fp16", "Q6_K"),
    ("gguf", "Q5_K"),
    ("w8a8", "float"),  # "w8a8_packed" where the native op and an int8 GEMM run here, else bf16
    ("int4_w8a8", "Q4_1"),  # "int4_w8a8_packed" (same fallback: "int4_onednn" / "int4")
    ("int8_blocks_w8a8", "Q8_0"),  # "int8_blocks_w8a8_packed" (fallback "int8_blocks_onednn")
    ("q4_blocks_w8a8", "Q4_1"),  # "q4_blocks_w8a8_packed" (fallback "q4_blocks_onednn")
    ("q4_blocks_w8a8", "Q4_K"),
    ("q4_blocks_w8a8", "Q8_0"),  # not a Q4 type: "w8a8_packed"
    ("q4_blocks", "Q4_0"),  # "q4_blocks_onednn" where oneDNN packs float32 here, else "onednn" / "dense"
    ("q4_blocks", "Q4_1"),
    ("q4_blocks", "Q4_K"),
    ("q4_blocks", "Q8_0"),  # not a Q4 type: the q8_blocks layout (either keeps every type it has one for)
    ("q4_blocks", "Q6_K"),  # "q8_blocks_onednn" with a scale per 16
    ("q8_blocks", "Q8_0"),  # "q8_blocks_onednn" where oneDNN packs float32 here, else "onednn" / "dense"
    ("q8_blocks", "Q6_K"),
    ("q8_blocks", "Q5_0"),  # values q - 16 with d per 32: tiles too
    ("q8_blocks", "Q4_1"),  # not Q8_0: the q4_blocks layout
    ("q8_blocks", "Q5_K"),  # "q8_blocks_mins_onednn": values, scales and mins
    ("q4_blocks", "Q5_K"),
    ("q4_blocks_a8", "Q4_1"),  # "q4_blocks_a8_onednn" (x quantized to Q8_0 at one row)
    ("q8_blocks_a8", "Q8_0"),  # "q8_blocks_a8_onednn"
    ("q8_blocks_a8", "Q5_0"),
    # K-quant sources, plain or stacked: "kquants_a8" (every row of x to Q8_K, the file's blocks) where
    # the native library runs, else the Q8_0-x layouts below
    ("q4_blocks_a8", "Q4_K"),
    ("q8_blocks_a8", "Q6_K"),
    ("q4_blocks_a8", "Q5_K"),
    ("q4_blocks_a8", "Q4_K+Q6_K"),
    ("q8_blocks_a8", "Q5_K+Q6_K"),
    ("q4_blocks_a8", "Q4_K+Q8_0"),  # a part that is no K-quant: "q8_blocks_mins_a8_onednn" (a min per 16)
    ("q8_blocks_a8", "Q6_K+Q8_0"),  # "q8_blocks_a8_onednn", a weight scale per 16
    # "kquants" (exact, the file's blocks) for K-quant sources, plain or stacked where its kernels run;
    # the exact blocks layouts for the others
    ("kquants", "Q4_K"),
    ("kquants", "Q6_K"),
    ("kquants", "Q5_K"),
    ("kquants", "Q4_K+Q6_K"),  # (distinct types: a call's case names a stack by its types)
    ("kquants", "Q4_K+Q8_0"),
    ("kquants", "Q4_1"),
    ("fp16", "Q5_0"),  # CUDA: every GGUF type above and this one in "gguf_planar_*"
    # fused projections whose parts mix GGUF types (a Q4_K_M file's QKV): the exact formats keep them as
    # values with a scale and min per 16 ("q8_blocks_mins_onednn") or per 32, or without mins
    # ("q8_blocks_onednn"); others, and CUDA, dequantize them ("dense")
    ("q4_blocks", "Q4_K+Q4_K+Q6_K"),
    ("q8_blocks", "Q5_K+Q6_K"),
    ("q4_blocks", "Q4_K+Q8_0"),
    ("q8_blocks", "Q6_K+Q8_0"),
    ("fp16", "Q4_K+Q6_K"),
)


# Fewest output columns a fuzz case has. ||out - ref|| / ||ref|| over one output is one ratio: a sum
# that cancels to a few % of its typical size turns the bf16 rounding of each product (2^-9, relative)
# into more than any fixed bound allows (w4a16 in bf16 at N = 1: 5 seeds in 300 over 0.016). Over 4
# outputs all four must cancel at once; N % 16 still reaches every ragged tail.
_MIN_FUZZ_N = 4


def _fuzz_shapes(rng):
    shapes = []
    for i, (fmt, source) in enumerate(_FUZZ_FORMATS):
        # int4 packs 16 rows at a time
        n = 16 * rng.randint(1, 6) if fmt.startswith("int4") else rng.randint(_MIN_FUZZ_N, 100)
        k = 32 * rng.randint(1, 8) if source != "float" else rng.randint(1, 300)  # GGUF: whole blocks
        if fmt == "int8" and source == "float" and i % 2 == 0:
            k = INT8_K_MULTIPLE * rng.randint(1, 18)
        if any(q in K_QUANTS for q in source.split("+")):
            k = QK_K * rng.randint(1, 2)  # whole super-blocks
        rows = (1, rng.randint(2, 70))
        if fmt in (*EXACT_FORMATS, "kquants") and source != "float":  # past the row kernels: the panel
            rows += (rng.randint(65, 130),)
        for m in rows:
            shapes.append(
                {"M": m, "N": n, "K": k, "format": fmt, "source": source, "bias": (i + m) % 2 == 1,
                 "float32_out": i % 3 == 1}
            )  # fmt: skip
    for i, source in enumerate(_QUANTIZED_SOURCES):
        n, k = rng.randint(_MIN_FUZZ_N, 70), rng.randint(1, 300)
        if source.startswith("fp8_block"):
            n, k = rng.randint(100, 300), rng.randint(100, 300)  # partial blocks in both directions
        if source == "sparse24":
            k = 4 * rng.randint(1, 75)  # whole groups of four
        for m in (1, rng.randint(2, 40)):
            shapes.append(
                {"M": m, "N": n, "K": k, "format": "kernel", "source": source, "bias": (i + m) % 2 == 0,
                 "float32_out": i % 3 == 2}
            )  # fmt: skip
    return shapes


def _case_tolerance(shape, dtype) -> float:
    """The result is rounded to x's dtype (GEMM_TOLERANCE[dtype]), and inside the layout: "bf16" and
    "int4" round x (and their output) to bfloat16 (unit roundoff 2^-9; int4's scales and zeros are
    bf16 too, but the reference reads those stored values), as "int8_blocks" does for several rows (its
    one-row GEMV computes in float32 on the stored values); "fp16" rounds a one-row x and its output
    to float16 (2^-11); "fp16" for several rows and "fp32" compute in float32 on the stored values.
    (On CUDA every format prepares to "dense" / "gguf_*" in x's dtype: the bound is then loose.)"""
    fmt = shape["format"]
    if fmt == "kernel":
        # the reference quantizes x as the kernel does (a tie resolved differently moves one
        # element by one step: rare); int4_linear rounds the dequantized weight to x's dtype.
        return max(GEMM_TOLERANCE[dtype], GEMM_TOLERANCE[torch.float32])
    if fmt in W8A8_FALLBACK and not cpu_w8a8.load():  # the formats they fall back to (bf16 copies)
        fmt = W8A8_FALLBACK[fmt]
    if fmt in W8A8_FALLBACK and (fmt == "w8a8" or shape["M"] > 1):
        # the reference quantizes x as the op does and reads the int8 copy: a tie rounded the other way
        # moves one element of x by one step (rare); the op rounds its float32 result once at the end
        inside = GEMM_TOLERANCE[torch.float32]
    elif fmt in ("bf16", "int4", "int4_bf16", "int4_w8a8", "int8") or (
        fmt == "int8_blocks" and (shape["M"] > 1 or not onednn_packs_bf16())  # else the "bf16" layout
    ):
        inside = GEMM_TOLERANCE[torch.bfloat16]  # the bf16 copies also round the weight to bf16
    elif fmt == "fp16" and shape["M"] == 1:
        inside = GEMM_TOLERANCE[torch.float16]
    else:
        inside = GEMM_TOLERANCE[torch.float32]
    return max(GEMM_TOLERANCE[dtype], inside)


def _blocks_rows_read_blocks(kind: str, m: int, tiles: bool = True) -> bool:
    """Whether m rows of x run the "q4" / "q8" blocks layouts' own kernels (the row kernel up to
    native_cpu.blocks_gemm_rows(), the tile kernel over blocks_tiles_rows(kind) where the layout has
    tiles, the panel kernel beyond where native_cpu.blocks_panel_runs()) rather than the float32 copy,
    on this build."""
    if native_cpu.blocks_panel_runs():  # more rows: the panel kernel on the blocks
        return True
    return m <= native_cpu.blocks_gemm_rows() or (tiles and native_cpu.blocks_tiles_take(kind, m))


def _weight_bytes(shape, dtype) -> float:
    """Bytes the CPU layout reads per call: fp32 / bf16 the matrix; fp16 the fp16 matrix for one row,
    its float32 copy for more; int4 the nibbles and a bf16 (scale, zero) per 32 weights; gguf the file's
    blocks (on CUDA the engine reads their planes, gguf_planar: 4.625 bits a weight for Q4_K where the
    file has 4.5; counting the file's bytes keeps the roofline % comparable with gguf_linear's and says
    what the planes cost);
    q4_blocks / q8_blocks the blocks (or their tiles: Q4_0 / Q4_1's d and m as float16) for as many rows
    as their kernels take here, the float32 copy for more; int8_blocks the values and scales for one
    row, the bf16 copy for more; the checkpoint layouts ("kernel") on the CPU: w4a16 its nibbles,
    zeros and scales, fp8 / int8 a float32 matrix, sparse24 the kept half in x's dtype and positions."""
    N, K, fmt = shape["N"], shape["K"], shape["format"]
    if fmt == "kernel":
        source = shape["source"]
        if source.startswith("w4a16"):
            return N * K / 2 + N * -(-K // W4A16_LAYOUTS[source][0]) * 5  # float32 scale, uint8 zero
        if source == "sparse24":  # the kept half in x's dtype and 4 bits of positions per group of 4
            return N * K / 2 * element_size(dtype) + N * K / 8
        return N * K * (4 if source.startswith(("fp8", "int8")) else 1)  # CPU: float32 values
    if fmt == "gguf":
        return packed_bytes({"N": N, "K": K, "qtype": shape["source"]})
    kquant_parts = shape["source"].split("+")
    all_kquants = all(q in cpu_kquants_a8.QTYPE_IDS for q in kquant_parts)
    # where a K-quant source keeps its file's blocks (KQUANT_LAYOUTS: a stacked weight's split evenly
    # between its parts)
    if (fmt == "kquants" and all_kquants and kquants_layout_runs()) or (
        fmt in A8_FORMATS and all_kquants and cpu_kquants_a8.load()
    ):
        return sum(N * row_bytes(q, K) for q in kquant_parts) / len(kquant_parts)
    if fmt == "kquants":
        fmt = "q4_blocks"  # its other sources: the exact blocks layouts
    blocks_formats = (*EXACT_FORMATS, *A8_FORMATS)  # each keeps every GGUF type with a blocks layout
    if fmt in blocks_formats and shape["source"] in MIN_QTYPES:  # values, d * sc and the min
        reads_blocks = _blocks_rows_read_blocks("q8", shape["M"], tiles=False)
        return N * K + N * K / 32 * 8 if reads_blocks else N * K * 4
    if fmt in blocks_formats and "+" in shape["source"]:  # stacked: values, a scale (and min) per block
        qtypes = shape["source"].split("+")
        floats = 2 if any(q in WITH_MINS for q in qtypes) else 1
        block = min(scale_group(q) for q in qtypes)
        tiles = floats == 1 and block == INT8_BLOCK_SIZE
        if not _blocks_rows_read_blocks("q8", shape["M"], tiles=tiles):
            return N * K * 4
        return N * K + N * K / block * 4 * floats
    exact_blocks = EXACT_BLOCKS_FORMAT.get(shape["source"]) if fmt in EXACT_FORMATS else None
    exact_blocks = A8_BLOCKS_FORMAT.get(shape["source"]) if fmt in A8_FORMATS else exact_blocks
    fmt = exact_blocks or fmt  # the layout each of those keeps the source in
    q4_blocks = fmt in ("q4_blocks", "q4_blocks_a8", "q4_blocks_w8a8") and shape["source"] in INT4_QTYPES
    blocks_rows = Q4_W8A8_EXACT_ROWS if fmt == "q4_blocks_w8a8" else 1  # rows that read the blocks
    if q4_blocks and shape["M"] <= blocks_rows:  # the nibbles and a float32 d and m per 32
        return N * K / 2 + N * K / 32 * 8
    if fmt == "w8a8" or (fmt in W8A8_FALLBACK and shape["M"] > 1):  # the int8 copy and a scale per row
        return N * K + N * 4
    if fmt in ("int4", "int4_w8a8") or (fmt == "int4_bf16" and shape["M"] == 1):
        return N * K / 2 + N * K / 32 * 4
    if fmt == "int4_bf16":  # several rows read the bf16 copy
        return N * K * 2
    if fmt == "int8":
        return N * K + N * 2
    if q4_blocks and _blocks_rows_read_blocks("q4", shape["M"]):  # (q4_blocks_w8a8 returned above)
        tiles = native_cpu.blocks_tiles_take("q4", shape["M"])
        scale_bytes = 2 if tiles and shape["source"] in ("Q4_0", "Q4_1") else 4  # the tiles' float16 d, m
        return N * K / 2 + N * K / 32 * 2 * scale_bytes
    if q4_blocks:  # several rows: the float32 copy
        return N * K * 4
    if fmt in ("int8_blocks", "int8_blocks_w8a8"):  # one row: the values and a float32 scale per 32
        return N * K + N * K / 32 * 4 if shape["M"] == 1 else N * K * 2
    if fmt in ("q8_blocks", "q8_blocks_a8") and shape["source"] in BLOCKS_FORMATS[fmt][1]:  # values, d
        group = scale_group(shape["source"])  # (Q6_K: a scale per 16, no tiles)
        reads_blocks = _blocks_rows_read_blocks("q8", shape["M"], tiles=group == INT8_BLOCK_SIZE)
        return N * K + N * K / group * 4 if reads_blocks else N * K * 4
    if fmt == "fp16":
        return N * K * (2 if shape["M"] == 1 else 4)
    return N * K * (2 if fmt == "bf16" else 4)


def gguf_source(weight) -> tuple[torch.Tensor, str] | None:
    """(GGUF blocks uint8 [N, row_bytes], qtype) a weight made by this spec's input maker was prepared
    from, or None (a float source, or tensors it did not make)."""
    return _GGUF_BLOCKS.get(id(weight[0]))


def _gguf_linear_blocks(x, layout, weight, bias=None, out_dtype=None):
    """kiln.ops.gguf_linear on the GGUF blocks the weight was prepared from (the file's bytes, decoded in
    registers): what the planes of "gguf_planar_*" are measured against on CUDA."""
    blocks = gguf_source(weight)
    if layout not in PLANAR_LAYOUTS or blocks is None:
        raise BaselineNotApplicable("only GGUF weights in planes (CUDA)")
    return gguf_linear(x, blocks[0], blocks[1], bias).to(out_dtype or x.dtype)


def _bf16_matmul(x, layout, weight, bias=None, out_dtype=None):
    """The same layer as a bf16 GEMM (cuBLAS on CUDA) on the matrix the weight stands for: for the GGUF
    layouts, planes and blocks (the CPU formats are compared with torch_linear_fp32)."""
    if layout not in PLANAR_LAYOUTS and layout not in GGUF_LAYOUTS:
        raise BaselineNotApplicable("only GGUF weights")
    dense = bf16_matmul(x, weight[0], lambda: _float32_matrix(layout, weight, x), bias)
    return dense.to(out_dtype or x.dtype)


def _bytes(shape, dtype) -> float:
    M, N, K = shape["M"], shape["N"], shape["K"]
    return _weight_bytes(shape, dtype) + (M * K + M * N) * element_size(dtype)


def _torch_linear_fp32(x, layout, weight, bias=None, out_dtype=None):
    """F.linear with the float32 matrix: what a layer without a prepared weight would run (on the CPU;
    the CUDA GGUF planes are compared with gguf_linear on the blocks and bf16 cuBLAS instead)."""
    if layout in PLANAR_LAYOUTS:
        raise BaselineNotApplicable("the CUDA GGUF planes: see gguf_linear_blocks, torch_bf16_matmul")
    matrix = _float32_matrix(layout, weight, x)
    y = torch.nn.functional.linear(x.float(), matrix, None if bias is None else bias.float())
    return y.to(out_dtype or x.dtype)


def _float32_matrix(layout, weight, x) -> torch.Tensor:
    """The float32 [N, K] matrix the weight stands for, on x's device (the baselines' weight): the one
    the input maker remembered, else read back from the layout and remembered."""
    matrix = _BASELINE_MATRICES.get(id(weight[0]))
    if matrix is None:
        matrix = prepared_matrix(layout, weight, x.shape[-1]).to(device=x.device, dtype=torch.float32)
        _remember_matrix(weight[0], matrix)
    return matrix


# The engine's CPU GEMMs: SmolLM2-135M's projections at decode sizes, in each CPU format.
_BENCH_FORMATS = (
    ("fp32", "float"), ("fp16", "float"), ("bf16", "float"),
    ("int4", "Q4_1"), ("int4_bf16", "Q4_1"), ("int4_w8a8", "Q4_1"), ("int8", "Q4_1"), ("w8a8", "float"),
    ("q4_blocks", "Q4_1"), ("q4_blocks_a8", "Q4_1"), ("q4_blocks_w8a8", "Q4_1"),
)  # fmt: skip

# (K, N, GGUF type): QKV, o_proj, gate/up, down (Q4_K, and Q6_K where llama.cpp gives it more bits),
# the tied head
_Q4_K_M_SHAPES = (
    (1024, 1536, "Q4_K"), (1024, 1024, "Q4_K"), (1024, 5632, "Q4_K"), (2816, 1024, "Q4_K"),
    (2816, 1024, "Q6_K"), (1024, 49152, "Q6_K"),
)  # fmt: skip

PREPARED_LINEAR = OpSpec(
    name="prepared_linear",
    description="y = x @ W^T (+ bias), W prepared at load (oneDNN-packed, fp16 GEMV, int4, GGUF blocks)",
    reference=prepared_linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    tolerance=GEMM_TOLERANCE,
    case_tolerance=_case_tolerance,
    flops=gemm_flops,
    bytes=_bytes,
    bench_shapes={
        "llm": [
            {"M": m, "N": n, "K": k, "format": fmt, "source": source}
            for k, n in SMOLLM2_135M
            for m in (1, 16, 64)
            for fmt, source in _BENCH_FORMATS
        ]
        + [  # the LM head (its GGUF type is Q8_0): packed bf16 against Q8_0's own values
            {"M": m, "N": 49152, "K": 576, "format": fmt, "source": "Q8_0"}
            for m in (1, 16)
            for fmt in ("fp16", "bf16", "q8_blocks", "q8_blocks_a8", "int8_blocks", "int8_blocks_w8a8")
        ]
        + [  # a Llama Q4_K_M's matrices (scripts/llama_q4_k_m_gguf.py: hidden 1024, intermediate 2816,
            # tied Q6_K head) at decode: exact blocks against x quantized to Q8_K on the file's blocks
            {"M": m, "N": n, "K": k, "format": fmt, "source": source}
            for k, n, source in _Q4_K_M_SHAPES
            for m in (1, 16)
            for fmt in ("q4_blocks", "q4_blocks_a8")
        ],
        # GGUF weights as the engine runs them on CUDA ("gguf_planar_*"), beside gguf_linear on the
        # file's blocks and bf16 cuBLAS (the baselines); bytes: the file's (_weight_bytes)
        "quant": [{**s, "format": "gguf", "source": q} for s in quant_shapes() for q in QUANT_QTYPES],
    },
    baselines={
        "torch_linear_fp32": _torch_linear_fp32,
        "gguf_linear_blocks": _gguf_linear_blocks,
        "torch_bf16_matmul": _bf16_matmul,
    },
    schema="(Tensor x, str layout, Tensor[] weight, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor",
    validate=validate_prepared_linear,
    copy_inputs=_copy_inputs,
    fake=_fake,
    call_case=_call_case,
    doc=__doc__,
)

prepared_linear = define_op(PREPARED_LINEAR, "kiln.ops")
