"""Rotary position embedding: the cos/sin cache built once per model, applied in place to q and k."""

from __future__ import annotations

from typing import Any

import torch

import kiln.ops


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE (NeoX half-split pairs, what HF Llama/Mistral/Qwen2 use) to the first `rotary_dim`
    dims of every head.

    cos_sin_cache: float32 [max_position, rotary_dim] (cos of the rotary_dim / 2 frequencies, then sin).
    inv_freq: optional explicit frequencies [rotary_dim / 2] (GGUF files that carry rope_freqs);
    otherwise `base` and the HF `scaling` dict define them.
    """

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None,
        device: torch.device,
        inv_freq: torch.Tensor | None = None,
    ):
        super().__init__()
        self.rotary_dim = rotary_dim
        if inv_freq is not None:
            angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
            cache = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
        else:
            cache = kiln.ops.rope_cos_sin_cache(rotary_dim, max_position, base, scaling, torch.float32, None)
        self.cos_sin_cache = cache.to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T]; q [T, Hq, D], k [T, Hk, D], rotated in place and returned."""
        return kiln.ops.rotary_embedding(positions, q, k, self.cos_sin_cache, True)
