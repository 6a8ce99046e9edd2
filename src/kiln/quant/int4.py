"""Group-wise asymmetric int4 (W4A16) weights: RTN quantizer, packing, dequantization.

Layout used by `kiln.ops.int4_linear` (the checkpoint's [out, in] = [N, K] orientation, packed along K):
    qweight: int32 [N, ceil(K / 8)]   nibble i (bits 4i..4i+3) of word j holds q[n, 8j + i], 0..15;
                                      the padding nibbles past K are 0
    scales:  [N, G] float             G = ceil(K / group_size), group g covers k in [g*gs, (g+1)*gs)
    zeros:   uint8 [N, G]             zero points 0..15
    w[n, k] = (q[n, k] - zeros[n, k // gs]) * scales[n, k // gs]
K need not be a multiple of group_size (the last group is short) nor of 8.
"""

from __future__ import annotations

import torch

GROUP_SIZES = (32, 64, 128)
NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integer values 0..15 [N, K] -> int32 [N, ceil(K / 8)] (low nibble first)."""
    N, K = q.shape
    words = -(-K // 8)
    padded = torch.zeros((N, words * 8), dtype=torch.int32, device=q.device)
    padded[:, :K] = q.to(torch.int32)
    nibbles = padded.reshape(N, words, 8) << NIBBLE_SHIFTS.to(q.device)
    # The nibbles occupy disjoint bits: or-ing the 8 shifted columns (nibble 7 reaches the sign bit).
    out = nibbles[..., 0].clone()
    for i in range(1, 8):
        out |= nibbles[..., i]
    return out


def unpack_int4(qweight: torch.Tensor, K: int) -> torch.Tensor:
    """int32 [N, words] -> uint8 [N, K] values 0..15."""
    nibbles = (qweight.unsqueeze(-1) >> NIBBLE_SHIFTS.to(qweight.device)) & 0xF
    return nibbles.reshape(qweight.shape[0], qweight.shape[1] * 8)[:, :K].to(torch.uint8)


def expand_groups(t: torch.Tensor, group_size: int, K: int) -> torch.Tensor:
    """[N, G] per-group values -> [N, K] per-weight values."""
    return t.repeat_interleave(group_size, dim=1)[:, :K]


def dequantize_int4(qweight, scales, zeros, group_size: int, K: int, dtype: torch.dtype = torch.float32):
    """Packed int4 -> [N, K] in `dtype` (computed in float32, or float64 when asked for)."""
    compute = torch.float64 if dtype == torch.float64 or scales.dtype == torch.float64 else torch.float32
    q = unpack_int4(qweight, K).to(compute)
    z = expand_groups(zeros.to(compute), group_size, K)
    s = expand_groups(scales.to(compute), group_size, K)
    return ((q - z) * s).to(dtype)


def quantize_int4(weight: torch.Tensor, group_size: int = 128, scale_dtype: torch.dtype | None = None):
    """Round-to-nearest asymmetric int4 per group of `group_size` input features.

    weight [N, K] float -> (qweight int32 [N, ceil(K/8)], scales [N, G] in scale_dtype (default:
    weight's dtype), zeros uint8 [N, G]); each group's [min, max] maps onto 0..15.
    """
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantize_int4: group_size {group_size} unsupported, expected one of {GROUP_SIZES}")
    N, K = weight.shape
    G = -(-K // group_size)
    w = torch.zeros((N, G * group_size), dtype=torch.float32, device=weight.device)
    w[:, :K] = weight.float()
    groups = w.reshape(N, G, group_size)
    # The padding of a short last group must not widen its range: fill it with one of its values.
    if K % group_size:
        tail = groups[:, -1, : K % group_size]
        groups[:, -1, K % group_size :] = tail[:, :1]
    lo = groups.amin(-1).clamp(max=0.0)
    hi = groups.amax(-1).clamp(min=0.0)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = (torch.round(groups / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 15)
    q = q.reshape(N, -1)[:, :K]
    scale_dtype = scale_dtype or (weight.dtype if weight.dtype.is_floating_point else torch.float32)
    return pack_int4(q), scales.to(scale_dtype), zeros.to(torch.uint8)
