"""The CPU W8A8 GEMM of the "*w8a8_onednn" layouts: int8 weights per output channel, packed once for
oneDNN's int8 GEMM (VNNI / AMX where the host has them), and activations quantized to int8 per row
on every call, in one native op (cpu_w8a8.cpp, torch.ops.kiln_cpu.w8a8_linear; kiln.ops.native_cpu
builds it) with a fake implementation so a compiled graph holds it as one node.

    pack(matrix, smooth=None)  float [N, K] -> (packed int8, w_scale float32 [N], w_zero_point int64
                  [N], smooth float32 [K]) or None where the native op or oneDNN's int8 ops are missing
                  here (callers keep bf16 layouts)
    values(packed) -> the int8 [N, K] matrix a packed weight holds (the verifier's reference reads it)
    w8a8_linear(x, packed, w_scale, w_zero_point, smooth, bias, out_dtype) -> [M, N]

x's columns are multiplied by `smooth` (ones unless `smoothing_factors` set it from calibration:
SmoothQuant, Xiao et al. 2023: y = (x * smooth) @ (W / smooth)^T moves activation peaks, which
per-row int8 cannot hold, into weight columns, which per-channel int8 holds better); then the per-row
scale is s = max(amax, 1e-12) / 127 and q = round-half-even(x / s) in [-127, 127]; the weight (W /
smooth) the same per output channel. On a 2-core Xeon with AMX, SmolLM2-135M's decoder GEMMs at 16
rows, cache-cold, against oneDNN's bf16 GEMM on packed weights: 11.1 vs 16.2 ms and, another day,
16.2 vs 17.7 ms; at 270 rows (prefill) slower, 84 vs 61 ms, where the float32 result and its per-row
rescale cost more than the int8 GEMM saves. Accuracy and engine speed: README, "A second host".
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.ops.gemm.scaled import AMAX_FLOOR, INT8_MAX

_state: dict = {"loaded": None}


def load() -> bool:
    """Load Kiln's native CPU library and register this op's fake, once per process; True when the op
    and oneDNN's int8 ops it calls are usable."""
    if _state["loaded"] is None:
        ops = getattr(torch.ops, "onednn", None)
        has_onednn = torch.backends.mkldnn.is_available() and all(
            hasattr(ops, name) for name in ("qlinear_prepack", "qlinear_pointwise")
        )
        _state["loaded"] = has_onednn and native_cpu.load()
        if _state["loaded"]:
            _register_fake()
            _state["loaded"] = _runs()
    return _state["loaded"]


def _runs() -> bool:
    """Whether oneDNN here takes int8 activations in its int8 GEMM (some PyTorch builds accept uint8
    only): one tiny call, so a load-time failure becomes the bf16 fallback, not a crash later."""
    try:
        packed = torch.ops.onednn.qlinear_prepack(torch.ones(16, 16, dtype=torch.int8), None)
        ones, zeros = torch.ones(16), torch.zeros(16, dtype=torch.int64)
        y = torch.ops.kiln_cpu.w8a8_linear(torch.ones(2, 16), packed, ones, zeros, ones, None, torch.float32)
    except RuntimeError:
        return False
    return torch.allclose(y, torch.full((2, 16), 16.0))  # 16 products of 127 levels, times 1 / 127


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::w8a8_linear")
    def _(x, weight, w_scale, w_zero_point, smooth, bias, out_dtype):
        return x.new_empty((x.shape[0], w_scale.shape[0]), dtype=out_dtype)


def quantize_per_channel(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """matrix float [N, K] -> (int8 [N, K], float32 scales [N]), symmetric: scale = max(amax, 1e-12) / 127,
    values round(w / scale) in [-127, 127]."""
    w = matrix.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp_min(AMAX_FLOOR) / INT8_MAX
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def pack(matrix: torch.Tensor, smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | None:
    """matrix float [N, K] on the CPU -> (oneDNN's packed int8 weight of matrix / smooth, reporting
    shape [K, N], w_scale float32 [N], w_zero_point int64 [N] zeros, smooth float32 [K]; ones when
    None), or None where the op cannot run here."""
    if matrix.device.type != "cpu" or matrix.dim() != 2 or 0 in matrix.shape or not load():
        return None
    smooth = torch.ones(matrix.shape[1]) if smooth is None else smooth.to(torch.float32).contiguous()
    values, scale = quantize_per_channel(matrix.to(torch.float64) / smooth.to(torch.float64))
    try:  # contiguous: the packing reads the values' memory as [N, K] whatever their strides say
        packed = torch.ops.onednn.qlinear_prepack(values.contiguous(), None)
    except RuntimeError:  # oneDNN without int8 support for this CPU
        return None
    return packed, scale.contiguous(), torch.zeros(matrix.shape[0], dtype=torch.int64), smooth


def values(packed: torch.Tensor) -> torch.Tensor:
    """The int8 [N, K] matrix a weight from `pack` holds, read back through oneDNN's own GEMM on an
    identity matrix (exact: each output is one stored value times 1); `to_dense()` of the packing
    does not transpose it back for every shape."""
    k, n = packed.shape
    identity = torch.eye(k, dtype=torch.int8)
    unit, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    columns = torch.ops.onednn.qlinear_pointwise(
        identity, 1.0, 0, packed, unit, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )
    return columns.t().to(torch.int8)


def quantize_rows_reference(x: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> what the op multiplies, as float64: v = x * smooth, s = max(amax, 1e-12) / 127 and
    round(v * (1 / s)) * s per row, each step in float32 as the op rounds it (so the integer levels
    are the op's exactly; the reference's float64 starts after them)."""
    v = x.to(torch.float32) * smooth.to(torch.float32)
    scale = v.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR) / INT8_MAX
    levels = torch.round(v * (1 / scale)).clamp(-INT8_MAX, INT8_MAX)
    return levels.double() * scale.double()


def w8a8_linear(x, packed, w_scale, w_zero_point, smooth, bias, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] float32 / bfloat16 / float16 -> [M, N] in out_dtype (see the module docstring); bias
    float [N] or None. Requires load() to have returned True (pack() checks it)."""
    return torch.ops.kiln_cpu.w8a8_linear(x, packed, w_scale, w_zero_point, smooth, bias, out_dtype)


def smoothing_factors(input_peaks: torch.Tensor, matrix: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's per-input-column factors for x [*, K] @ matrix [N, K]^T: smooth_k =
    max|W[:, k]|^(1 - alpha) / max|x[:, k]|^alpha (x is multiplied by it, W divided), from the
    activation peaks measured on calibration text (input_peaks float [K]). Columns the calibration
    never saw nonzero keep 1; the rest are clamped to [1e-2, 1e2] (SmolLM2's span 0.045-44), so a
    column that was quiet on the short calibration text cannot scale a later peak out of range."""
    x_peak = input_peaks.to(torch.float64)
    w_peak = matrix.to(torch.float64).abs().amax(dim=0)
    smooth = w_peak.clamp_min(1e-8) ** (1 - alpha) / x_peak.clamp_min(1e-8) ** alpha
    seen = (x_peak > 0) & (w_peak > 0)
    return torch.where(seen, smooth.clamp(1e-2, 1e2), torch.ones_like(smooth)).to(torch.float32)
