"""AWQ checkpoints (AutoAWQ's GEMM layout, config `quant_method: "awq"`, `version: "gemm"`) ->
int4_linear's layout, once, at load. AWQ's own packer needs a GPU, so this layout is checked by
known-answer tests on the documented bit layout (tests/quant/test_awq_gptq.py).

A Linear with in_features K, out_features N and group size g stores, in the [in, out] orientation:
    qweight int32 [K, N / 8]   word j of row k holds columns 8j .. 8j + 7, in AWQ's interleaved
                               order: nibble i (bits 4i .. 4i + 3) is column 8j + AWQ_ORDER[i],
                               AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
    qzeros  int32 [K / g, N / 8]   zero points 0..15, packed the same way
    scales  fp16  [K / g, N]
    w[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]     (y = x @ w; no +1 on the zeros)
Conversion: unpack, undo the interleave, transpose to [N, K], pack along K (kiln.quant.int4).
"""

from __future__ import annotations

import torch

from kiln.quant.linear_weights import Int4Weight, int4_weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's order -> int32 [R, C] values 0..15 (columns in natural order)."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS) & 0xF  # [R, C / 8, 8]: nibble i
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] values 0..15 (C a multiple of 8) -> int32 [R, C / 8] in AWQ's order (the inverse of
    unpack_awq; what AutoAWQ's packer writes)."""
    r, c = values.shape
    columns = values.to(torch.int32).reshape(r, c // 8, 8)
    nibbles = columns[..., list(AWQ_ORDER)] << _SHIFTS
    out = nibbles[..., 0].clone()
    for i in range(1, 8):
        out |= nibbles[..., i]
    return out


def awq_to_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> Int4Weight:
    """AWQ GEMM tensors (above) -> Int4Weight [N, K]. ValueError on shapes that do not agree."""
    k, words = qweight.shape
    n = words * 8
    groups = -(-k // group_size) if group_size > 0 else 1
    for name, t, shape in (("qzeros", qzeros, (groups, words)), ("scales", scales, (groups, n))):
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name}: shape {tuple(t.shape)}, expected {shape} for qweight {tuple(qweight.shape)}"
            )
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight / qzeros: {qweight.dtype} / {qzeros.dtype}, expected int32")
    q = unpack_awq(qweight).T.contiguous()  # [N, K]
    zeros = unpack_awq(qzeros).T.contiguous()  # [N, G]
    return int4_weight(q, scales.T.contiguous(), zeros, group_size)
