"""How an output is compared with its float64 reference."""

from __future__ import annotations

import math

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf anywhere the reference is finite gives inf,
    so a NaN can never pass. Rounding to zero below the output dtype's smallest subnormal is not counted.
    Both all-zero gives 0; a nonzero output against a zero reference gives inf."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out64 = out.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref.detach().to(device="cpu", dtype=torch.float64)
    ref_finite = torch.isfinite(ref64)
    if bool((~torch.isfinite(out64) & ref_finite).any()):
        return math.inf
    # Where the reference itself is not finite (e.g. -inf log-sum-exp of an empty row) it must match exactly.
    if not bool(ref_finite.all()):
        if not torch.equal(out64[~ref_finite], ref64[~ref_finite]):
            return math.inf
        out64, ref64 = out64[ref_finite], ref64[ref_finite]
    diff = torch.linalg.vector_norm(out64 - ref64).item()
    norm = torch.linalg.vector_norm(ref64).item()
    if out.dtype.is_floating_point and out.dtype != torch.float64:
        # Below half the output dtype's smallest subnormal a value can only round to 0 (fp16: 3e-8):
        # that much error per element is the format's, not the kernel's.
        finfo = torch.finfo(out.dtype)
        diff = max(0.0, diff - 0.5 * finfo.smallest_normal * finfo.eps * math.sqrt(out64.numel()))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> float:
    """Assert ||out - ref|| / ||ref|| <= tol (NaN never passes); returns the error for reporting."""
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"
    return err
