"""LongRoPE (Phi-3 / Phi-3.5, rope_type "longrope", called "su" in early Phi-3 configs): the cos/sin
table for `kiln.ops.rope_cos_sin_cache`.

    scaling = {"rope_type": "longrope", "short_factor": [r floats], "long_factor": [r floats],
               "original_max_position_embeddings": L, optional "factor" s, optional "attention_factor" m}
    (r = rotary_dim // 2). Frequencies f_i = base ** (-2i / rotary_dim) / ext_i, with ext the short
    factors for positions p < L and the long factors for p >= L. Both cos and sin are multiplied by
      m = attention_factor when given, else sqrt(1 + ln(s) / ln(L)) when s > 1, else 1,
    with s = factor when given, else max_position / L (HF's rule: the model's max_position_embeddings
    over the pre-training length).

Short or long, by position. transformers picks one set for a whole sequence from its current length:
the short factors while it is at most L tokens long, the long ones for every position once it is longer
(and then recomputes the keys of the whole sequence). A paged KV cache keeps each key as it was rotated
when written, so Kiln picks per position instead: the table holds short-factor rows below L and
long-factor rows from L on. For every sequence of at most L tokens this is exactly transformers';
past L, the positions below L keep their short-factor rotation where transformers would re-rotate them
with the long factors (llama.cpp instead fixes one set per context size, vLLM per batch).
"""

from __future__ import annotations

import math

import torch

OP = "rope_cos_sin_cache"


def _factors(scaling: dict, key: str, pairs: int) -> torch.Tensor:
    values = scaling.get(key)
    if values is None:
        raise ValueError(f"{OP}: longrope scaling needs key {key!r}, got keys {sorted(scaling)}")
    factors = torch.as_tensor(values, dtype=torch.float64).flatten()
    if factors.numel() != pairs:
        raise ValueError(
            f"{OP}: longrope {key} has {factors.numel()} entries, expected rotary_dim // 2 = {pairs}"
        )
    if not bool((factors > 0).all()) or not bool(torch.isfinite(factors).all()):
        raise ValueError(f"{OP}: longrope {key} must be finite and positive, got {values!r}")
    return factors


def longrope_original_max(scaling: dict) -> int:
    """L, the pre-training context length: the position where the long factors start."""
    value = scaling.get("original_max_position_embeddings")
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(
            f"{OP}: longrope scaling needs original_max_position_embeddings, an integer >= 2, got {value!r}"
        )
    return value


def longrope_attention_factor(scaling: dict, max_position: int) -> float:
    """m, the factor both cos and sin are multiplied by (see the module docstring)."""
    if scaling.get("attention_factor") is not None:
        factor = float(scaling["attention_factor"])
        if not factor > 0 or not math.isfinite(factor):
            raise ValueError(f"{OP}: longrope attention_factor must be positive, got {factor!r}")
        return factor
    original = longrope_original_max(scaling)
    scale = scaling.get("factor")
    scale = max_position / original if scale is None else float(scale)
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"{OP}: longrope factor must be positive, got {scale!r}")
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


def longrope_inv_freqs(rotary_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(short, long) inverse frequencies, float64 [rotary_dim // 2] each, on the CPU."""
    pairs = rotary_dim // 2
    plain = 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return plain / _factors(scaling, "short_factor", pairs), plain / _factors(scaling, "long_factor", pairs)


def longrope_cos_sin(rotary_dim: int, max_position: int, base: float, scaling: dict) -> torch.Tensor:
    """float64 [max_position, rotary_dim]: m * [cos | sin] of p * f(p), f the short frequencies for
    p < L and the long ones for p >= L."""
    short, long = longrope_inv_freqs(rotary_dim, base, scaling)
    original = longrope_original_max(scaling)
    mscale = longrope_attention_factor(scaling, max_position)
    positions = torch.arange(max_position, dtype=torch.float64)
    inv_freq = torch.where((positions < original)[:, None], short[None, :], long[None, :])
    angles = positions[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * mscale
