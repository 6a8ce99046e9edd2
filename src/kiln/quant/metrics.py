"""Quantization error of one matrix: SNR, cosine similarity and max abs error of w_hat against w.
Norms accumulate in float64 so a large weight's metrics do not depend on summation order."""

from __future__ import annotations

import math

import torch


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(||w||^2 / ||w - w_hat||^2); inf when exact."""
    ref = reference.float().flatten()
    noise = torch.linalg.vector_norm(ref - approx.float().flatten(), dtype=torch.float64).item()
    signal = torch.linalg.vector_norm(ref, dtype=torch.float64).item()
    if noise == 0.0:
        return math.inf
    return 20.0 * math.log10(signal / noise) if signal > 0 else -math.inf


def cosine_similarity(reference: torch.Tensor, approx: torch.Tensor) -> float:
    a, b = reference.double().flatten(), approx.double().flatten()
    denom = (torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)).item()
    return float((a @ b).item() / denom) if denom > 0 else (1.0 if torch.equal(a, b) else 0.0)


def max_abs_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return (reference.float() - approx.float()).abs().max().item() if reference.numel() else 0.0


def error_metrics(reference: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """{"snr_db", "cosine", "max_abs_error"} of approx against reference (same shape)."""
    if reference.shape != approx.shape:
        raise ValueError(f"error_metrics: shapes differ, {tuple(reference.shape)} vs {tuple(approx.shape)}")
    return {
        "snr_db": snr_db(reference, approx),
        "cosine": cosine_similarity(reference, approx),
        "max_abs_error": max_abs_error(reference, approx),
    }
