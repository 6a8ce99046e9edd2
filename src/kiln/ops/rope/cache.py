"""The rotary-embedding cos/sin cache, built once per model.

rope_cos_sin_cache(rotary_dim, max_position, base, scaling, dtype, device)
    -> [max_position, rotary_dim], row p = [cos(p f_0) .. cos(p f_{r-1}), sin(p f_0) .. sin(p f_{r-1})]
    with r = rotary_dim // 2 frequencies f_i = base ** (-2i / rotary_dim), adjusted by `scaling`:
      None (or rope_type "default"): as is.
      {"rope_type": "linear", "factor": s}: f_i / s (positions interpolated by s).
      {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
       "original_max_position_embeddings"}: Llama-3.1's band-wise rule, as HF transformers'
       `_compute_llama3_parameters` defines it: with L = original_max_position_embeddings and
       wavelength w_i = 2*pi / f_i, frequencies with w_i < L / high_freq_factor are kept, those with
       w_i > L / low_freq_factor are divided by factor, and those in between are blended,
       (1 - t) * f_i / factor + t * f_i with t = (L / w_i - low_freq_factor) / (high - low).
      {"rope_type": "longrope" (or "su"), "short_factor", "long_factor",
       "original_max_position_embeddings", ...}: Phi-3's LongRoPE, frequencies divided per pair by the
       short factors below position L and by the long ones from L on, cos and sin multiplied by an
       attention factor (kiln.ops.rope.longrope has the rule and why the choice is by position).
The angles p * f_i are computed in float64 (then rounded once to `dtype`, the same on every CPU:
kiln.ops.float64_rounding): in float32 a position
of 100k times a frequency of ~1 is off by ~1e-2 radians.
"""

from __future__ import annotations

import math

import torch

from kiln.ops.float64_rounding import round_from_float64
from kiln.ops.rope.longrope import longrope_cos_sin

SCALING_TYPES = ("default", "linear", "llama3", "longrope")
LONGROPE_ALIASES = ("longrope", "su")  # early Phi-3 configs say "su"


def rope_inv_freq(rotary_dim: int, base: float = 10000.0, scaling: dict | None = None) -> torch.Tensor:
    """The `rotary_dim // 2` (scaled) inverse frequencies, float64 `[rotary_dim // 2]` on the CPU."""
    op = "rope_cos_sin_cache"
    _check_dim_and_base(rotary_dim, base)
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    rope_type = _rope_type(scaling)
    if rope_type == "longrope":
        raise ValueError(
            f"{op}: longrope frequencies depend on the position (short factors below "
            "original_max_position_embeddings, long ones after); use rope_cos_sin_cache or "
            "kiln.ops.rope.longrope.longrope_inv_freqs"
        )
    if rope_type not in SCALING_TYPES:
        raise ValueError(
            f"{op}: scaling rope_type {rope_type!r} is not supported (supported: {SCALING_TYPES})"
        )
    if rope_type == "default":
        return inv_freq
    factor = _scaling_value(scaling, "factor")
    if rope_type == "linear":
        return inv_freq / factor
    low = _scaling_value(scaling, "low_freq_factor")
    high = _scaling_value(scaling, "high_freq_factor")
    old_context = _scaling_value(scaling, "original_max_position_embeddings")
    if not high > low:
        raise ValueError(
            f"{op}: llama3 scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}"
        )
    wavelen = 2 * math.pi / inv_freq
    blend = (old_context / wavelen - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_context / high, inv_freq, scaled)


def _check_dim_and_base(rotary_dim: int, base: float) -> None:
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_cos_sin_cache: rotary_dim must be a positive even int, got {rotary_dim!r}")
    if not base > 0:
        raise ValueError(f"rope_cos_sin_cache: base must be positive, got {base!r}")


def _rope_type(scaling: dict | None) -> str:
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    return "longrope" if rope_type in LONGROPE_ALIASES else rope_type


def _scaling_value(scaling: dict, key: str) -> float:
    if key not in scaling:
        raise ValueError(
            f"rope_cos_sin_cache: scaling {scaling.get('rope_type')!r} needs key {key!r}, got {scaling}"
        )
    value = scaling[key]
    if not value > 0:
        raise ValueError(f"rope_cos_sin_cache: scaling {key} must be positive, got {value!r}")
    return float(value)


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float = 10000.0,
    scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """cos/sin table `[max_position, rotary_dim]` (first half cos, second half sin) for
    `rotary_embedding`; see the module docstring for `scaling`. dtype float32 (default) / fp16 / bf16."""
    if not isinstance(max_position, int) or max_position <= 0:
        raise ValueError(f"rope_cos_sin_cache: max_position must be a positive int, got {max_position!r}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(
            f"rope_cos_sin_cache: dtype {dtype} is not a float dtype (use float32, float16 or bfloat16)"
        )
    if _rope_type(scaling) == "longrope":
        _check_dim_and_base(rotary_dim, base)
        return round_from_float64(longrope_cos_sin(rotary_dim, max_position, base, scaling), dtype).to(device)
    inv_freq = rope_inv_freq(rotary_dim, base, scaling)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return round_from_float64(torch.cat([angles.cos(), angles.sin()], dim=-1), dtype).to(device)


def rope_tuning_shape(q, k, cos_sin_cache, is_neox) -> dict:
    """The tuning-cache shape dict of rotary_embedding and qk_norm_rope (their specs share the keys) for
    q [T, Hq, D], k [T, Hkv, D] and a [max_position, rotary_dim] cache; keys left out at their default."""
    shape = {"tokens": q.shape[0], "q_heads": q.shape[1], "kv_heads": k.shape[1], "head_dim": q.shape[2]}
    shape["max_position"] = cos_sin_cache.shape[0]
    if cos_sin_cache.shape[1] != q.shape[2]:
        shape["rotary_dim"] = cos_sin_cache.shape[1]
    if not is_neox:
        shape["is_neox"] = False
    return shape
