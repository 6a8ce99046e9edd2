"""AWQ's activation-aware scaling (Lin et al., "AWQ: Activation-aware Weight Quantization", 2023):
the search for one group of projections that share an input.

For projections W [N, K] fed by activations x [T, K], scaling input channel k of every W by s_k and
dividing the same channel of x by s_k (folded into the op that produced x) leaves x @ W.T unchanged in
exact arithmetic, but moves quantization error away from the channels that carry large activations:
with s = mean|x|^alpha, a salient channel's weights get more of the quantization grid. `search_scale`
tries alpha on a grid over [0, 1] (alpha = 0 is plain round-to-nearest) and keeps the one whose
fake-quantized output x @ (Q(W diag(s)) diag(1/s)).T is closest to the float output on the
calibration activations. Where s is folded is the caller's business (kiln.entrypoints.quantize).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ALPHAS = tuple(i / 20 for i in range(21))  # 0, 0.05, ..., 1


@dataclass
class ScaleSearch:
    """The result of one search: scale float32 [K] (all ones when alpha is 0), the alpha it came from,
    the mean squared output error with it and with plain round-to-nearest (alpha 0)."""

    scale: torch.Tensor
    alpha: float
    error: float
    rtn_error: float


def awq_scale(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha for float32 [K] per-channel mean magnitudes, normalised so that
    max(s) * min(s) = 1 (keeps the scaled weights' range centred; AWQ's normalisation)."""
    s = mean_abs.float().clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def output_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean squared difference of x @ weight.T and x @ approx.T (x [T, K], weights [N, K] float32)."""
    return (x @ (approx - weight).T).square().mean().item()


def search_scale(
    weight: torch.Tensor,
    x: torch.Tensor,
    fake_quantize: Callable[[torch.Tensor], torch.Tensor],
    alphas: tuple[float, ...] = ALPHAS,
) -> ScaleSearch:
    """The best AWQ scale for `weight` float32 [N, K] (a group's projections stacked by rows) on its
    input activations `x` float32 [T, K]. fake_quantize maps a float32 [N, K] weight to its
    quantize->dequantize version (per-row groups or channels, so stacking the projections does not
    change any one's quantization). alphas must include 0 (the round-to-nearest baseline)."""
    if 0.0 not in alphas:
        raise ValueError("search_scale: the alpha grid must include 0 (round-to-nearest)")
    if weight.dim() != 2 or x.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"search_scale: weight {tuple(weight.shape)} and x {tuple(x.shape)} disagree on K")
    weight, x = weight.float(), x.float()
    mean_abs = x.abs().mean(0)
    best: ScaleSearch | None = None
    rtn_error = float("nan")
    for alpha in alphas:
        s = awq_scale(mean_abs, alpha) if alpha else torch.ones_like(mean_abs)
        error = output_error(x, weight, fake_quantize(weight * s) / s)
        if alpha == 0.0:
            rtn_error = error
        if best is None or error < best.error:
            best = ScaleSearch(s, alpha, error, float("nan"))
    best.rtn_error = rtn_error
    return best
