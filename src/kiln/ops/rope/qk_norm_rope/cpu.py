"""Fast CPU path for qk_norm_rope: PyTorch's fused CPU RMSNorm into a float32 buffer, the rotation
in place in that buffer (vectorized on strided views), one copy back into q and k."""

from __future__ import annotations

import torch

from kiln.ops.registry import Implementation, cpu_only
from kiln.ops.rope.qk_norm_rope.spec import QK_NORM_ROPE


def _norm_rotate_(x, weight, cos, sin, eps, is_neox):
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)  # a new buffer
    rotary_dim = 2 * cos.shape[-1]
    if is_neox:
        y1, y2 = y[..., : rotary_dim // 2], y[..., rotary_dim // 2 : rotary_dim]
    else:
        y1, y2 = y[..., 0:rotary_dim:2], y[..., 1:rotary_dim:2]
    # y1' goes to a new buffer first, so y2' (computed in place) still reads the original y1.
    out1 = (y1 * cos).addcmul_(y2, sin, value=-1.0)
    y2.mul_(cos).addcmul_(y1, sin)
    y1.copy_(out1)
    x.copy_(y)


def qk_norm_rope_cpu(positions, q, k, q_weight, k_weight, cos_sin_cache, eps=1e-6, is_neox=True):
    cos_sin = cos_sin_cache.index_select(0, positions).float()  # [T, rotary_dim]
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    _norm_rotate_(q, q_weight, cos, sin, eps, is_neox)
    _norm_rotate_(k, k_weight, cos, sin, eps, is_neox)
    return q, k


QK_NORM_ROPE.register(Implementation("cpu", qk_norm_rope_cpu, cpu_only))
