"""Per-output-channel FP8 (e4m3) and INT8 weight quantizers for `fp8_linear` / `int8_linear`.

weight [N, K] float -> (w_q [N, K] float8_e4m3fn or int8, scale float32 [N, 1]) with
scale = max(amax_row, 1e-12) / qmax and w ~= w_q * scale (symmetric, round to nearest).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
INT8_MAX = 127.0


def _row_scale(weight: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    return w, w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, scale = _row_scale(weight, FP8_MAX)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, scale = _row_scale(weight, INT8_MAX)
    q = torch.sign(w / scale) * torch.floor((w / scale).abs() + 0.5)
    return q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_per_channel(w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w_q.float() * scale.float()
