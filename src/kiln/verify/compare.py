"""How an output is compared with its float64 reference."""

from __future__ import annotations

import math

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf anywhere the reference is finite gives inf,
    so a NaN can never pass. Rounding to zero below the output dtype's smallest subnormal is not counted.
    Both all-zero gives 0; a nonzero output against a zero reference gives inf."""
    return errors(out, ref)[0]


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float64 (inf for a NaN where the reference is finite): the norm
    error averages over every element, so one wrong element in a large tensor can hide in it; this
    cannot hide an element that is wrong by more than that fraction of the largest value."""
    return errors(out, ref)[1]


def pointwise_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over elements of |out - ref| / (u * (|ref| + POINTWISE_FLOOR * max|ref|) + half the smallest
    subnormal), u the output dtype's unit roundoff: one correct rounding of the exact value gives at
    most 1. For ops whose every output element is one value rounded once (elementwise ops, norms,
    softmax, copies, dequantization)."""
    return errors(out, ref, pointwise=True)[2]


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


def errors(
    out: torch.Tensor, ref: torch.Tensor, pointwise: bool = False
) -> tuple[float, float, float | None]:
    """(relative_error, max_error, pointwise_error or None unless asked) from one float64 copy of each.
    ValueError for shapes that differ (and for pointwise, an output dtype without a unit roundoff)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out64 = out.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref.detach().to(device="cpu", dtype=torch.float64)
    finite = torch.isfinite(ref64)
    # a NaN / inf where the reference is finite never passes; where the reference itself is not
    # finite (e.g. the -inf log-sum-exp of an empty row) the output must match it exactly
    if bool((~torch.isfinite(out64) & finite).any()) or not torch.equal(out64[~finite], ref64[~finite]):
        return math.inf, math.inf, math.inf if pointwise else None
    out64, ref64 = out64[finite], ref64[finite]
    if out64.numel() == 0:
        return 0.0, 0.0, 0.0 if pointwise else None
    diff = (out64 - ref64).abs()
    magnitude = ref64.abs()
    scale = magnitude.max().item()
    # Below half the output dtype's smallest subnormal a value can only round to 0 (fp16: 3e-8):
    # that much error per element is the format's, not the kernel's.
    subnormal = 0.0
    if out.dtype.is_floating_point and out.dtype != torch.float64:
        finfo = torch.finfo(out.dtype)
        subnormal = 0.5 * finfo.smallest_normal * finfo.eps
    norm_diff = max(0.0, torch.linalg.vector_norm(diff).item() - subnormal * math.sqrt(out64.numel()))
    max_diff = max(0.0, diff.max().item() - subnormal)
    norm = torch.linalg.vector_norm(ref64).item()
    norm_error = norm_diff / norm if norm else (0.0 if norm_diff == 0.0 else math.inf)
    max_err = max_diff / scale if scale else (0.0 if max_diff == 0.0 else math.inf)
    rounding = None
    if pointwise:
        if out.dtype not in UNIT_ROUNDOFF:
            raise ValueError(f"pointwise_error: no unit roundoff for {out.dtype}")
        if scale == 0.0:
            rounding = 0.0 if bool((diff == 0).all()) else math.inf
        else:
            bound = UNIT_ROUNDOFF[out.dtype] * (magnitude + POINTWISE_FLOOR * scale) + subnormal
            rounding = (diff / bound).max().item()
    return norm_error, max_err, rounding


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> float:
    """Assert ||out - ref|| / ||ref|| <= tol (NaN never passes); returns the error for reporting."""
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"
    return err
