"""quantize_int8: symmetric per-token INT8 activation quantization, amax + scale + round fused.

x: [M, K] float32 / float16 / bfloat16
-> (x_int8 [M, K] int8, scale float32 [M, 1]) with scale = max(amax_row, 1e-12) / 127 and
x_int8 = round-half-away-from-zero(x / scale), so x ~= x_int8 * scale.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_nonempty_rows, check_tensor, row_count
from kiln.ops.gemm.scaled import AMAX_FLOOR, INT8_MAX, TIE_RTOL, make_quantize_inputs, snapped_scale
from kiln.ops.gemm.shapes import fuzz_quantize_shapes, quantize_bytes, quantize_flops
from kiln.ops.registry import OpSpec, define_op


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: ties go away from zero (what the kernels do)."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_int8_reference(x):
    # defined in float32, as every backend runs it (see quantize_fp8's reference)
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / INT8_MAX
    return round_half_away(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def verified_outputs(result, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) with the slack a correct kernel has snapped to the exact quantization of x (float64):
    a scale within SCALE_RTOL of max(amax, AMAX_FLOOR) / 127 becomes that value (in the scale's dtype),
    a code one step from round_half_away(exact x / scale) where that quotient lies within TIE_RTOL
    (relative) of a .5 tie becomes the exact code. The verifier runs this on the reference's result and
    on the implementation's alike; both then match bit for bit, so the tolerance is 0: any other code
    (one step off away from a tie) or a scale off by more (stored in float16, or 0.1% large) fails,
    where one 5e-3 norm bound on codes and scale together once hid them. (An OpSpec has one tolerance
    per dtype for all its outputs, hence the slack is taken out here.) Dtypes and shapes are kept, so
    the op's contract is still checked on them."""
    codes, scale = result
    x = inputs["x"].detach().to(device="cpu", dtype=torch.float64)
    exact_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / INT8_MAX
    exact = x / exact_scale
    nearest = round_half_away(exact).clamp(-INT8_MAX, INT8_MAX)
    magnitude = exact.abs()
    near_tie = (magnitude - magnitude.floor() - 0.5).abs() <= TIE_RTOL * magnitude
    got_codes = codes.detach().to(device="cpu", dtype=torch.float64)
    snap_code = near_tie & ((got_codes - nearest).abs() <= 1)
    return (
        torch.where(snap_code, nearest, got_codes).to(device=codes.device, dtype=codes.dtype),
        snapped_scale(scale, exact_scale),
    )


def validate_quantize_int8(x) -> None:
    check_tensor("quantize_int8", "x", x, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    check_nonempty_rows("quantize_int8", x)


def _fake(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


QUANTIZE_INT8 = OpSpec(
    name="quantize_int8",
    description="fused per-token amax + scale + round to int8 (symmetric)",
    reference=quantize_int8_reference,
    make_inputs=make_quantize_inputs,
    fuzz_shapes=fuzz_quantize_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # exact: verified_outputs takes out the float32 rounding of a correct kernel first
    tolerance={torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0},
    flops=quantize_flops,
    bytes=quantize_bytes,
    outputs=verified_outputs,
    bench_shapes={"llm": [{"M": m, "K": k} for k in (4096, 14336, 576) for m in (1, 64, 2048, 8192)]},
    schema="(Tensor x) -> (Tensor, Tensor)",
    validate=validate_quantize_int8,
    fake=_fake,
    call_case=lambda x: ({"M": row_count(x), "K": x.shape[-1]}, x.dtype),
    doc=__doc__,
)

quantize_int8 = define_op(QUANTIZE_INT8, "kiln.ops")
