"""How an output is compared with its float64 reference."""

from __future__ import annotations

import math

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf anywhere the reference is finite gives inf,
    so a NaN can never pass. Rounding to zero below the output dtype's smallest subnormal is not counted.
    Both all-zero gives 0; a nonzero output against a zero reference gives inf."""
    pair = _finite_pair(out, ref)
    if pair is None:
        return math.inf
    out64, ref64 = pair
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


# the largest relative error of one round-to-nearest into each output dtype (unit roundoff)
UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float8_e4m3fn: 2.0**-4,
    torch.float8_e5m2: 2.0**-3,
}
# below this fraction of the tensor's largest magnitude an element is judged by absolute error: the
# cancellation that leaves a value near zero (a mean subtracted, rotated pairs) is not a rounding
POINTWISE_FLOOR = 2.0**-10


def _finite_pair(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float64 CPU copies where the reference is finite; None when out is NaN/inf where ref is not, or
    differs from a non-finite ref (e.g. the -inf log-sum-exp of an empty row must match exactly)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out64 = out.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref.detach().to(device="cpu", dtype=torch.float64)
    finite = torch.isfinite(ref64)
    if bool((~torch.isfinite(out64) & finite).any()):
        return None
    if not bool(finite.all()):
        if not torch.equal(out64[~finite], ref64[~finite]):
            return None
        out64, ref64 = out64[finite], ref64[finite]
    return out64, ref64


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float64 (inf for a NaN where the reference is finite): the norm
    error averages over every element, so one wrong element in a large tensor can hide in it; this
    cannot hide an element that is wrong by more than that fraction of the largest value."""
    pair = _finite_pair(out, ref)
    if pair is None:
        return math.inf
    out64, ref64 = pair
    if out64.numel() == 0:
        return 0.0
    diff, scale = (out64 - ref64).abs().max().item(), ref64.abs().max().item()
    if out.dtype.is_floating_point and out.dtype != torch.float64:
        finfo = torch.finfo(out.dtype)  # rounding into the subnormal range, as in relative_error
        diff = max(0.0, diff - 0.5 * finfo.smallest_normal * finfo.eps)
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def pointwise_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over elements of |out - ref| / (u * (|ref| + POINTWISE_FLOOR * max|ref|) + half the smallest
    subnormal), u the output dtype's unit roundoff: one correct rounding of the exact value gives at
    most 1. For ops whose every output element is one value rounded once (elementwise ops, norms,
    softmax, copies, dequantization)."""
    pair = _finite_pair(out, ref)
    if pair is None:
        return math.inf
    out64, ref64 = pair
    if out64.numel() == 0:
        return 0.0
    u = UNIT_ROUNDOFF.get(out.dtype)
    if u is None:
        raise ValueError(f"pointwise_error: no unit roundoff for {out.dtype}")
    scale = ref64.abs().max().item()
    finfo = torch.finfo(out.dtype)
    # + half the smallest subnormal: what rounding into the format's subnormal range can cost
    bound = u * (ref64.abs() + POINTWISE_FLOOR * scale) + 0.5 * finfo.smallest_normal * finfo.eps
    diff = (out64 - ref64).abs()
    if scale == 0.0:
        return 0.0 if bool((diff == 0).all()) else math.inf
    return (diff / bound).max().item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> float:
    """Assert ||out - ref|| / ||ref|| <= tol (NaN never passes); returns the error for reporting."""
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"
    return err
