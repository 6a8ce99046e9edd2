"""The prepared_linear layouts of quantized checkpoint weights (kiln.quant.linear_weights): how each
is placed on a device, what it computes, and the float64 matrix and activations it stands for.

    layout               tensors                                       runs
    "fp8_dynamic"        [w [N, K], w_scale f32 [N, 1]]                x quantized per token (quantize_fp8),
    "int8_dynamic"                                                     then fp8_linear / int8_linear
    "fp8_static"         [w, w_scale, x_scale f32 [1]]                 x quantized with the checkpoint's
    "int8_static"                                                      per-tensor scale, then the same GEMM
    "w4a16_g<gs>"        [qweight int32 [N, ceil(K/8)], scales [N, G], int4_linear (group size gs = 32, 64,
                          zeros uint8 [N, G]]                          128)
    "w4a16_g<gs>_perm"   + [perm int64 [K]]                            int4_linear on x[:, perm] (act-order)
    "fp8_block<bn>x<bk>" [w e4m3fn [N, K], scale f32 [N/bn, K/bk]]     fp8_block_linear (x quantized per
                                                                       token and bk-group inside the GEMM)
    "sparse24"           [values [N, K/2] x's dtype, meta uint8        sparse24_linear (2:4 weight expanded
                          [N, ceil(K/8)]]                              in registers)
    "sparse24_semi"      + [PyTorch semi-structured weight,            the same below `crossover` rows, the
                          crossover int64 0-d CPU tensor]              semi-structured GEMM from there on

W8A8 weights: on CUDA w is the checkpoint's e4m3fn / int8 matrix; on the CPU it is the same values in
float32 (exact), converted once here rather than on every call as fp8_linear's / int8_linear's CPU
paths do: the CPU runs the same quantize-x, integer-valued matmul, scale-the-result arithmetic as
those ops. Activations are quantized as compressed-tensors defines it (its fake-quantized forward
is what transformers runs on these checkpoints): fp8 x / scale clamped to +-448 and cast (round to
nearest even); int8 x / scale rounded half to even and clamped to [-128, 127]. Static: the
checkpoint's input_scale. Dynamic per token: fp8 scale = amax / 448 (Kiln's quantize_fp8, the same
definition); int8 scale = amax / 127.5 (half the int8 range, 255 / 2; Kiln's quantize_int8 and vLLM
use amax / 127, a different grid: on the tiny test model that alone moved the logits by 16%).
Block FP8 runs fp8_block_linear on CUDA; on the CPU its layout keeps the dequantized float32 matrix
(block scales applied once) and quantizes x per token and group as that op does, so both devices
compute what the checkpoint format says. 2:4 sparse weights run sparse24_linear on CUDA, and from
the batch size where PyTorch's semi-structured sparse GEMM is measured faster on that GPU
(kiln.ops.gemm.sparse24_dispatch) that one; on the CPU they are expanded to a dense matrix once at
load (no CPU sparse GEMM beats the dense one).
W4A16 runs int4_linear on CUDA; on the CPU, where PyTorch
has no faster kernel for it than a dense GEMM, the loader dequantizes it once (weight_formats;
logged), except that `cpu_format="int4"` repacks it into torch's int4 CPU layout where it fits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.fp8_block_linear import fp8_block_linear
from kiln.ops.gemm.fp8_block_linear.cpu import quantize_dequantize_groups
from kiln.ops.gemm.fp8_block_linear.spec import quantize_groups_reference
from kiln.ops.gemm.fp8_linear import fp8_linear
from kiln.ops.gemm.int4_linear import int4_linear
from kiln.ops.gemm.int8_linear import int8_linear
from kiln.ops.gemm.quantize_fp8 import quantize_fp8
from kiln.ops.gemm.sparse24_dispatch import prepare_sparse24_dispatch, use_semi_structured
from kiln.ops.gemm.sparse24_linear import sparse24_linear
from kiln.quant.int4 import GROUP_SIZES, dequantize_int4
from kiln.quant.linear_weights import BlockFP8Weight, Int4Weight, ScaledWeight
from kiln.quant.sparse24 import Sparse24Weight, decompress_24

FP8_MAX = 448.0
INT8_HALF_RANGE = 127.5  # (127 - (-128)) / 2: compressed-tensors' symmetric int8 scale divisor
W8A8_LAYOUTS = {  # layout -> (qtype, static activation scale)
    "fp8_dynamic": ("fp8", False),
    "fp8_static": ("fp8", True),
    "int8_dynamic": ("int8", False),
    "int8_static": ("int8", True),
}
W4A16_LAYOUTS = {  # layout -> (group size, permuted inputs)
    **{f"w4a16_g{gs}": (gs, False) for gs in GROUP_SIZES},
    **{f"w4a16_g{gs}_perm": (gs, True) for gs in GROUP_SIZES},
}
FP8_BLOCK_SIZES = ((128, 128),)
FP8_BLOCK_LAYOUTS = {f"fp8_block{bn}x{bk}": (bn, bk) for bn, bk in FP8_BLOCK_SIZES}
QUANTIZED_LAYOUTS = {
    **{name: 3 if static else 2 for name, (_, static) in W8A8_LAYOUTS.items()},
    **{name: 4 if perm else 3 for name, (_, perm) in W4A16_LAYOUTS.items()},
    **dict.fromkeys(FP8_BLOCK_LAYOUTS, 2),
    "sparse24": 2,
    "sparse24_semi": 4,
}
SPARSE24_LAYOUTS = ("sparse24", "sparse24_semi")
QDTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def w8a8_layout(weight: ScaledWeight, device: torch.device) -> tuple[str, tuple[torch.Tensor, ...]]:
    """(layout, tensors) of a W8A8 weight on `device` (CPU: the values in float32)."""
    data = weight.data.to(device)
    if device.type == "cpu":
        data = data.to(torch.float32)
    tensors = (data.contiguous(), weight.scale.to(device, torch.float32).reshape(-1, 1).contiguous())
    if weight.input_scale is not None:
        tensors += (weight.input_scale.to(device, torch.float32).reshape(1),)
    kind = "static" if weight.input_scale is not None else "dynamic"
    return f"{weight.qtype}_{kind}", tensors


def w4a16_layout(weight: Int4Weight, device: torch.device) -> tuple[str, tuple[torch.Tensor, ...]]:
    """(layout, tensors) of an int4 weight in int4_linear's layout on `device`."""
    if weight.group_size not in GROUP_SIZES:
        raise ValueError(f"w4a16_layout: group_size {weight.group_size}, int4_linear takes {GROUP_SIZES}")
    tensors = tuple(t.to(device).contiguous() for t in (weight.qweight, weight.scales, weight.zeros))
    if weight.perm is None:
        return f"w4a16_g{weight.group_size}", tensors
    return f"w4a16_g{weight.group_size}_perm", (*tensors, weight.perm.to(device, torch.int64))


def fp8_block_layout(weight: BlockFP8Weight, device: torch.device) -> tuple[str, tuple[torch.Tensor, ...]]:
    """(layout, tensors) of a block-scaled FP8 weight on `device`; on the CPU the first tensor is the
    dequantized float32 matrix (the block scales folded in once, here) and the scales are ones."""
    layout = f"fp8_block{weight.block[0]}x{weight.block[1]}"
    if layout not in FP8_BLOCK_LAYOUTS:
        sizes = ", ".join(f"{bn}x{bk}" for bn, bk in FP8_BLOCK_SIZES)
        raise ValueError(f"fp8_block_layout: block {weight.block}, fp8_block_linear takes {sizes}")
    data, scale = weight.data, weight.scale.to(torch.float32)
    if device.type == "cpu":
        data, scale = weight.dequantize(torch.float32), torch.ones_like(scale)
    return layout, (data.to(device).contiguous(), scale.to(device).contiguous())


def sparse24_layout(
    weight: Sparse24Weight, device: torch.device, dtype: torch.dtype
) -> tuple[str, tuple[torch.Tensor, ...]]:
    """(layout, tensors) of a 2:4 weight on `device`, its kept values in the activation dtype; on CUDA
    "sparse24_semi" with PyTorch's semi-structured copy where that GEMM wins from some batch size on."""
    tensors = (weight.values.to(device, dtype).contiguous(), weight.meta.to(device).contiguous())
    extra = prepare_sparse24_dispatch(*tensors)
    return ("sparse24_semi", (*tensors, *extra)) if extra else ("sparse24", tensors)


# ---- int4 checkpoints in torch's int4 CPU layout (weight_formats' "int4", groups of 32) ------------


def int4_cpu_packable(weight: Int4Weight) -> bool:
    """Whether torch's CPU int4 packing takes this weight: inputs in order, groups a multiple of 32
    with K a multiple of them, N a multiple of 16."""
    n, k = weight.shape
    gs = weight.group_size
    return weight.perm is None and gs % 32 == 0 and k % gs == 0 and n % 16 == 0


def int4_cpu_scales_and_zeros(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(nibbles int32 [N, K] 0..15, scales_and_zeros bf16 [K / 32, N, 2]) for torch's int4 CPU matmul,
    which computes (q - 8) * scale + zero: (q - z) * s is that with scale = s, zero = (8 - z) * s,
    every group split into groups of 32 with the same (scale, zero)."""
    from kiln.quant.int4 import unpack_int4

    n, k = weight.shape
    q = unpack_int4(weight.qweight, k).to(torch.int32)
    split = weight.group_size // 32
    s = weight.scales.float().repeat_interleave(split, 1)
    z = weight.zeros.float().repeat_interleave(split, 1)
    pairs = torch.stack([s, (8.0 - z) * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q, pairs


# ---- running them ------------------------------------------------------------------------------------


def quantize_static(x: torch.Tensor, x_scale: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [M, K] with a per-tensor scale [1] -> x_q [M, K] as compressed-tensors quantizes it."""
    v = x.to(torch.float32) / x_scale.to(torch.float32)
    if qtype == "fp8":
        return v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.round(v).clamp(-128, 127).to(torch.int8)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scale [M, 1]) with scale = max(amax, 1e-12) / 127.5,
    round half to even, clamp to [-128, 127] (compressed-tensors' dynamic per-token int8)."""
    v = x.to(torch.float32)
    scale = v.abs().amax(-1, keepdim=True).clamp(min=1e-12) / INT8_HALF_RANGE
    return torch.round(v / scale).clamp(-128, 127).to(torch.int8), scale


def run_w8a8(x, layout, weight, bias, out_dtype):
    """y = quantize(x) @ (w * w_scale)^T + bias in out_dtype (see the module docstring)."""
    qtype, static = W8A8_LAYOUTS[layout]
    w, w_scale = weight[0], weight[1]
    if static:
        x_scale = weight[2]
        x_q = quantize_static(x, x_scale, qtype)
    elif qtype == "fp8":
        x_q, x_scale = quantize_fp8(x, True)
    else:
        x_q, x_scale = quantize_int8_per_token(x)
    if w.dtype == torch.float32:  # the CPU's copy of the values
        y = F.linear(x_q.to(torch.float32), w).mul_(x_scale.reshape(-1, 1)).mul_(w_scale.reshape(1, -1))
        if bias is not None:
            y = y.add_(bias)
        return y.to(out_dtype)
    gemm = fp8_linear if qtype == "fp8" else int8_linear
    return gemm(x_q, x_scale, w, w_scale, None if bias is None else bias.to(out_dtype), out_dtype)


def run_w4a16(x, layout, weight, bias, out_dtype):
    """y = x[:, perm] @ dequantize(qweight, scales, zeros)^T + bias, through int4_linear."""
    group_size, permuted = W4A16_LAYOUTS[layout]
    if permuted:
        x = x.index_select(1, weight[3])
    y = int4_linear(x, weight[0], weight[1], weight[2], group_size)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype)


def run_fp8_block(x, layout, weight, bias, out_dtype):
    """y = fp8_block_linear(x, w, scale) + bias in out_dtype (CPU: x quantized per token and group
    as that op does, times the dequantized float32 matrix)."""
    bn, bk = FP8_BLOCK_LAYOUTS[layout]
    if weight[0].dtype == torch.float32:
        y = F.linear(quantize_dequantize_groups(x, bk), weight[0], None if bias is None else bias.float())
        return y.to(out_dtype or x.dtype)
    return fp8_block_linear(x, weight[0], weight[1], bn, bk, bias, out_dtype or x.dtype)


def run_quantized(x, layout, weight, bias, out_dtype):
    """Dispatch one of QUANTIZED_LAYOUTS (both backends call this: the ops it calls pick the device)."""
    if layout in W8A8_LAYOUTS:
        return run_w8a8(x, layout, weight, bias, out_dtype)
    if layout in W4A16_LAYOUTS:
        return run_w4a16(x, layout, weight, bias, out_dtype)
    if layout in SPARSE24_LAYOUTS:
        values = weight[0]
        bias = None if bias is None else bias.to(values.dtype)
        if use_semi_structured(x, weight[2:]):
            y = torch.nn.functional.linear(x.to(values.dtype), weight[2], bias)
        else:
            y = sparse24_linear(x.to(values.dtype), values, weight[1], bias)
        return y.to(out_dtype or x.dtype)
    return run_fp8_block(x, layout, weight, bias, out_dtype)


# ---- what they stand for (the verifier's reference) --------------------------------------------------


def quantized_matrix(layout: str, tensors, in_features: int | None = None) -> torch.Tensor:
    """The float64 [N, K] matrix a quantized layout stands for, in the model's input order. int4
    packing does not record K exactly (a short last group, padding nibbles): pass `in_features`
    (default: the smaller of 8 per word and group_size per group)."""
    if layout in W8A8_LAYOUTS:
        return tensors[0].to(torch.float64) * tensors[1].to(torch.float64).reshape(-1, 1)
    if layout in W4A16_LAYOUTS:
        group_size, permuted = W4A16_LAYOUTS[layout]
        k = tensors[3].numel() if permuted else in_features
        if k is None:
            k = min(tensors[0].shape[1] * 8, tensors[1].shape[1] * group_size)
        w = dequantize_int4(tensors[0], tensors[1], tensors[2], group_size, k, torch.float64)
        if not permuted:
            return w
        out = torch.empty_like(w)
        out[:, tensors[3]] = w
        return out
    if layout in SPARSE24_LAYOUTS:
        return decompress_24(tensors[0], tensors[1], torch.float64)
    bn, bk = FP8_BLOCK_LAYOUTS[layout]
    return BlockFP8Weight(tensors[0], tensors[1], (bn, bk)).dequantize(torch.float64)


def quantized_reference_input(layout: str, tensors, x: torch.Tensor) -> torch.Tensor:
    """x as the layout's kernel sees it after quantizing activations, as float64 (W8A8: per token or
    with the static scale; fp8_block: per token and group of bk inputs; W4A16: x unchanged)."""
    if layout in W8A8_LAYOUTS:
        # The quantizer is defined in float32 (compressed-tensors runs it in the activation dtype,
        # the kernels in float32); x's values are exact in float32. A tie x / scale = +-127.5 (the
        # amax element of an int8 row) must round as float32 rounds it, hence no float64 here.
        qtype, static = W8A8_LAYOUTS[layout]
        if static:
            q = quantize_static(x, tensors[2], qtype)
            return q.to(torch.float64) * tensors[2].to(torch.float64)
        if qtype == "int8":
            q, scale = quantize_int8_per_token(x)
        else:
            v = x.to(torch.float32)
            scale = v.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
            q = (v / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.to(torch.float64) * scale.to(torch.float64)
    x = x.to(torch.float64)
    if layout in FP8_BLOCK_LAYOUTS:
        return quantize_groups_reference(x, FP8_BLOCK_LAYOUTS[layout][1])
    return x
