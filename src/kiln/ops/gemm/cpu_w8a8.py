"""The CPU W8A8 GEMM of the "*w8a8_packed" layouts: int8 weights per output channel, packed once, and
activations quantized to int8 per row on every call, in one native op with a fake implementation so
a compiled graph holds it as one node (kiln.ops.native_cpu builds them). Two kernels:

    AMX tiles (cpu_w8a8_amx.cpp, torch.ops.kiln_cpu.w8a8_amx_linear) where the CPU has AMX int8
        (Sapphire Rapids and later) and KILN_CPU_AMX is not 0: Kiln's own tile loop, weights in
        `to_tiles` layout, each finished tile rescaled straight into the output;
    oneDNN's int8 GEMM elsewhere (cpu_w8a8.cpp, torch.ops.kiln_cpu.w8a8_linear; AVX512-VNNI etc.),
        weights packed by torch.ops.onednn.qlinear_prepack, levels passed as uint8 with zero point 128
        (int8 activations reach oneDNN's reference loop on CPUs without AMX).

    pack(matrix, smooth=None)  float [N, K] -> (packed int8, w_scale float32 [N], w_zero_point int64
                  [N], smooth float32 [K]) or None where neither kernel runs here (callers keep bf16
                  layouts)
    values(rows)  -> the int8 [N, K] matrix a pack() tuple holds (the verifier's reference reads it)
    w8a8_linear(x, packed, w_scale, w_zero_point, smooth, bias, out_dtype) -> [M, N], either kernel

x's columns are multiplied by `smooth` (ones unless `smoothing_factors` set it from calibration:
SmoothQuant, Xiao et al. 2023: y = (x * smooth) @ (W / smooth)^T moves activation peaks, which
per-row int8 cannot hold, into weight columns, which per-channel int8 holds better); then the per-row
scale is s = max(amax, 1e-12) / 127 and q = round-half-even(x / s) in [-127, 127]; the weight (W /
smooth) the same per output channel; int32 products, exact, then y = (acc * w_scale) * s + bias,
rounded once. SmolLM2-135M's 120 decoder GEMMs, cache-cold, on a 2-core Xeon with AMX
(scripts/cpu_w8a8_kernels.py, bench/results/2026-11-25-cpu-w8a8-kernels-intel-amx.json): 16 rows 4.6
ms on the tiles vs 8.3 ms through oneDNN; 1 row 3.9 vs 7.3 ms; 270 rows (prefill) 26.5 vs 42.7 ms;
the LM head at 270 rows 16.4 vs 43.8 ms. Accuracy and engine speed: README, "A second host".
"""

from __future__ import annotations

import os

import torch

from kiln.ops import native_cpu
from kiln.ops.gemm.scaled import AMAX_FLOOR, INT8_MAX

_state: dict = {"loaded": None, "amx": False, "onednn": False}
TILE_GROUP = 64  # the AMX layout pads N and K to multiples of this


def load() -> bool:
    """Load Kiln's native CPU library and register the ops' fakes, once per process; True when one of
    the two GEMMs runs here: the AMX tiles, or oneDNN's int8 ops (each probed once)."""
    if _state["loaded"] is None:
        _state["loaded"] = native_cpu.load()
        if _state["loaded"]:
            _register_fakes()
            _state["amx"] = torch.ops.kiln_cpu.amx_int8_available()
            _state["onednn"] = _onednn_runs()
            _state["loaded"] = _state["amx"] or _state["onednn"]
    return _state["loaded"]


def kernels() -> tuple[str, ...]:
    """The int8 GEMMs that run here, of "amx" (the CPU has AMX int8 tiles and Linux hands them to this
    process) and "onednn" (its int8 GEMM takes int8 activations), whatever KILN_CPU_AMX says."""
    load()
    return tuple(kernel for kernel in ("amx", "onednn") if _state[kernel])


def uses_amx() -> bool:
    """Whether pack() lays weights out for the AMX kernel: it runs here and KILN_CPU_AMX is not 0
    (which keeps oneDNN's packing, e.g. to compare)."""
    return "amx" in kernels() and os.environ.get("KILN_CPU_AMX", "1") != "0"


def _onednn_runs() -> bool:
    """Whether oneDNN's int8 GEMM runs here through the op (uint8 levels with zero point 128 against
    int8 weights) and gets the integer products right: one small call, so a load-time failure becomes
    the bf16 fallback, not a crash or a wrong answer later. On x86 CPUs without VNNI oneDNN multiplies
    with vpmaddubsw, whose int16 pair sums saturate, and halves the weights to avoid that (an AMD
    EPYC with AVX2 only: 11% error on random levels, 64.25 for a sum of 64): such a GEMM is refused."""
    ops = getattr(torch.ops, "onednn", None)
    if not torch.backends.mkldnn.is_available() or not all(
        hasattr(ops, name) for name in ("qlinear_prepack", "qlinear_pointwise")
    ):
        return False
    # levels that reach both ends of the range: x's rows hold a 127 (scale 1, so x is its own levels),
    # odd weights of both signs (halving them rounds), products whose pair sums pass int16
    generator = torch.Generator().manual_seed(0)
    weights = torch.randint(-127, 128, (16, 64), generator=generator, dtype=torch.int8)
    weights[:, :2] = 127
    x = torch.randint(-127, 128, (2, 64), generator=generator).float()
    x[:, :2] = 127.0
    try:
        packed = torch.ops.onednn.qlinear_prepack(weights, None)
        ones, zeros = torch.ones(16), torch.zeros(16, dtype=torch.int64)
        y = torch.ops.kiln_cpu.w8a8_linear(x, packed, ones, zeros, torch.ones(64), None, torch.float32)
    except RuntimeError:
        return False
    return torch.equal(y.double(), x.double() @ weights.double().T)  # integers below 2^24: exact


def _register_fakes() -> None:
    def output(x, w_scale, out_dtype):  # [M, N]: both ops
        return x.new_empty((x.shape[0], w_scale.shape[0]), dtype=out_dtype)

    torch.library.register_fake("kiln_cpu::w8a8_linear")(
        lambda x, weight, w_scale, w_zero_point, smooth, bias, out_dtype: output(x, w_scale, out_dtype)
    )
    torch.library.register_fake("kiln_cpu::w8a8_amx_linear")(
        lambda x, tiles, w_scale, smooth, bias, out_dtype: output(x, w_scale, out_dtype)
    )


def quantize_per_channel(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """matrix float [N, K] -> (int8 [N, K], float32 scales [N]), symmetric: scale = max(amax, 1e-12) / 127,
    values round(w / scale) in [-127, 127]."""
    w = matrix.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp_min(AMAX_FLOOR) / INT8_MAX
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def pack(matrix: torch.Tensor, smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, ...] | None:
    """matrix float [N, K] on the CPU -> (the int8 copy of matrix / smooth, w_scale float32 [N],
    w_zero_point int64 [N] zeros, smooth float32 [K]; ones when None), or None where neither GEMM
    runs here. The copy is AMX tiles (to_tiles) where uses_amx(), else oneDNN's packing (reporting
    shape [K, N]) where oneDNN's int8 GEMM runs (KILN_CPU_AMX=0 on a build where it does not: None).
    The kernel follows the copy: KILN_CPU_AMX affects weights packed after it is set."""
    if matrix.device.type != "cpu" or matrix.dim() != 2 or 0 in matrix.shape or not load():
        return None
    smooth = torch.ones(matrix.shape[1]) if smooth is None else smooth.to(torch.float32).contiguous()
    values, scale = quantize_per_channel(matrix.to(torch.float64) / smooth.to(torch.float64))
    if uses_amx():
        packed = to_tiles(values)
    elif "onednn" not in kernels():
        return None
    else:
        try:  # contiguous: the packing reads the values' memory as [N, K] whatever their strides say
            packed = torch.ops.onednn.qlinear_prepack(values.contiguous(), None)
        except RuntimeError:  # oneDNN without int8 support for this CPU
            return None
    return packed, scale.contiguous(), torch.zeros(matrix.shape[0], dtype=torch.int64), smooth


def tiles_shape(n: int, k: int) -> tuple[int, ...]:
    """The shape of to_tiles' layout for an [n, k] matrix."""
    return -(-n // TILE_GROUP), -(-k // TILE_GROUP), 4, 16, 64


def to_tiles(values: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the AMX kernel's layout, int8 [ceil(N / 64), ceil(K / 64), 4, 16, 64] (N and K
    padded with zeros): element [g, s, j, r, 4 c + i] = values[64 g + 16 j + c, 64 s + 4 r + i], the four
    16-column B tiles of column group g and K step s, each as TDPBSSD reads it (cpu_w8a8_amx.cpp)."""
    n, k = values.shape
    groups, steps = tiles_shape(n, k)[:2]
    padded = values.new_zeros(groups * TILE_GROUP, steps * TILE_GROUP)
    padded[:n, :k] = values
    tiles = padded.view(groups, 4, 16, steps, 16, 4).permute(0, 3, 1, 4, 2, 5)
    return tiles.contiguous().view(groups, steps, 4, 16, 64)


def values(rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The int8 [N, K] matrix a copy from `pack` (its whole tuple) holds. AMX tiles are unpermuted;
    oneDNN's packing is read back through oneDNN's own GEMM on an identity matrix (exact: each output
    is one stored value times 1), since `to_dense()` of it does not transpose back for every shape."""
    packed, w_scale, _, smooth = rows[:4]
    n, k = w_scale.shape[0], smooth.shape[0]
    if packed.dim() == 5:
        groups, steps = packed.shape[:2]
        matrix = packed.view(groups, steps, 4, 16, 16, 4).permute(0, 2, 4, 1, 3, 5)
        return matrix.reshape(groups * TILE_GROUP, steps * TILE_GROUP)[:n, :k]
    identity = torch.eye(k, dtype=torch.uint8) + 128  # as the op passes levels: uint8, zero point 128
    unit, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)
    columns = torch.ops.onednn.qlinear_pointwise(
        identity, 1.0, 128, packed, unit, zeros, None, 1.0, 0, torch.float32, "none", [], ""
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
    float [N] or None; the rest as pack() returns them. Requires load() to have returned True (pack()
    checks it)."""
    if packed.dim() == 5:
        return torch.ops.kiln_cpu.w8a8_amx_linear(x, packed, w_scale, smooth, bias, out_dtype)
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
