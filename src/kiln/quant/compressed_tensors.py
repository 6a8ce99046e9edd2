"""compressed-tensors and block-FP8 checkpoint tensors -> kiln.quant.linear_weights, once, at load.

compressed-tensors (config.json `quantization_config.quant_method == "compressed-tensors"`) stores a
quantized Linear `<module>` as:
    "float-quantized" / "naive-quantized" FP8: weight e4m3fn [N, K], weight_scale [N, 1] (channel)
        or [1] / [] (tensor), input_scale [1] when activations are static; w = weight * weight_scale.
    "int-quantized" / "naive-quantized" INT8: weight int8 [N, K], weight_scale as above.
    "pack-quantized" int4: weight_packed int32 [N, ceil(K / 8)] (element k of a row at bits
        4 * (k % 8) of word k // 8, stored as q + 8 with q in -8..7: the nibble layout of
        kiln.quant.int4), weight_scale [N, G], weight_shape [2] = (N, K), and when asymmetric
        weight_zero_point int32 [ceil(N / 8), G] (zero points z in -8..7 stored as z + 8, packed
        along N, 8 rows per word); w = (q - z) * weight_scale[n, k // group_size].
    So int4_linear's qweight is weight_packed unchanged and its zeros are the stored nibbles (z + 8;
    8 for symmetric weights). Checkpoints quantized with GPTQ's actorder "group" (llm-compressor
    until 2026-08) add weight_g_idx int32 [K]: column k belongs to group g_idx[k], not k // group_size;
    such a weight is stored with its columns sorted by group (Int4Weight.perm), as GPTQ's act-order.
Block FP8 (`quant_method == "fp8"` with `weight_block_size` [bn, bk], DeepSeek-V3 / Qwen3-FP8, and
compressed-tensors' "block" weight strategy): weight e4m3fn [N, K] and weight_scale_inv (or
weight_scale) float32 [ceil(N / bn), ceil(K / bk)], w = weight * scale of its block.
Bad shapes or dtypes raise ValueError naming the tensor (the loader adds the file).
"""

from __future__ import annotations

import torch

from kiln.quant.gptq import act_order_perm
from kiln.quant.int4 import GROUP_SIZES, unpack_int4
from kiln.quant.linear_weights import BlockFP8Weight, Int4Weight, ScaledWeight, int4_weight

QDTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def per_channel_scale(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A per-tensor ([], [1], [1, 1]) or per-channel ([N], [N, 1]) scale -> float32 [N, 1]."""
    _check(
        scale.numel() in (1, rows) and scale.dim() <= 2,
        f"{name}: shape {tuple(scale.shape)}, expected a per-tensor [1] or per-channel [{rows}, 1] scale",
    )
    return scale.to(torch.float32).reshape(-1, 1).expand(rows, 1).contiguous()


def scaled_weight(
    qtype: str, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None, name: str
) -> ScaledWeight:
    """A W8A8 weight from its stored tensors (`name`: the module, for errors)."""
    _check(
        weight.dtype == QDTYPES[qtype] and weight.dim() == 2,
        f"{name}.weight: {weight.dtype} {tuple(weight.shape)}, expected a {QDTYPES[qtype]} matrix",
    )
    scale = per_channel_scale(weight_scale, weight.shape[0], f"{name}.weight_scale")
    if input_scale is not None:
        _check(
            input_scale.numel() == 1,
            f"{name}.input_scale: {input_scale.numel()} values, expected 1 (per tensor)",
        )
        input_scale = input_scale.to(torch.float32).reshape(1)
    return ScaledWeight(qtype, weight.contiguous(), scale, input_scale)


def pack_quantized_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    in_features: int,
    group_size: int,
    zero_point: torch.Tensor | None,
    name: str,
    g_idx: torch.Tensor | None = None,
) -> Int4Weight:
    """compressed-tensors' pack-quantized 4-bit weight -> int4_linear's layout (see the module
    docstring: with a group size int4_linear takes, the words are kept as stored). group_size -1:
    per channel (one group per row); other sizes go through linear_weights.int4_weight.
    g_idx: int [K], input k's group (`weight_g_idx` of older checkpoints quantized with GPTQ's
    actorder "group": column k's scale and zero point are those of group g_idx[k]), or None; an
    act-order one is stored in the order where its groups are contiguous (Int4Weight.perm), as GPTQ's."""
    n, words = weight_packed.shape
    k = in_features
    _check(weight_packed.dtype == torch.int32, f"{name}.weight_packed: {weight_packed.dtype}, expected int32")
    _check(words == -(-k // 8), f"{name}.weight_packed: {words} words per row, expected ceil({k} / 8)")
    groups = 1 if group_size == -1 else -(-k // group_size)
    _check(
        tuple(weight_scale.shape) == (n, groups),
        f"{name}.weight_scale: shape {tuple(weight_scale.shape)}, expected ({n}, {groups})",
    )
    if zero_point is None:
        zeros = torch.full((n, groups), 8, dtype=torch.uint8)
    else:
        _check(
            zero_point.dtype == torch.int32 and tuple(zero_point.shape) == (-(-n // 8), groups),
            f"{name}.weight_zero_point: {zero_point.dtype} {tuple(zero_point.shape)}, expected int32 "
            f"({-(-n // 8)}, {groups}) (packed along the output rows)",
        )
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        nibbles = (zero_point.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # [N/8, 8, G]
        zeros = nibbles.reshape(-1, groups)[:n].to(torch.uint8)
    perm = None
    if g_idx is not None:
        try:
            perm = act_order_perm(g_idx, k, k if group_size == -1 else group_size)
        except ValueError as exc:
            raise ValueError(f"{name}.weight_g_idx: {exc}") from None
    if group_size in GROUP_SIZES and perm is None:
        return Int4Weight(weight_packed.contiguous(), weight_scale.contiguous(), zeros, group_size, k)
    q = unpack_int4(weight_packed, k).to(torch.int32)
    if perm is not None:
        q = q[:, perm]
    return int4_weight(q, weight_scale, zeros, group_size, perm)


def block_fp8_weight(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str
) -> BlockFP8Weight:
    """Block FP8: weight e4m3fn [N, K] and one float scale per (bn x bk) block."""
    _check(
        weight.dtype == torch.float8_e4m3fn and weight.dim() == 2,
        f"{name}.weight: {weight.dtype} {tuple(weight.shape)}, expected a float8_e4m3fn matrix",
    )
    n, k = weight.shape
    expected = (-(-n // block[0]), -(-k // block[1]))
    _check(
        tuple(scale.shape) == expected,
        f"{name}: block scale shape {tuple(scale.shape)}, expected {expected} ({block[0]}x{block[1]} blocks)",
    )
    return BlockFP8Weight(
        weight.contiguous(), scale.to(torch.float32).contiguous(), (int(block[0]), int(block[1]))
    )
