"""quantize_fp8: FP8 (e4m3fn) activation quantization, amax + scale + cast fused.

x:         [M, K] float32 / float16 / bfloat16
per_token: one scale per row (True) or one for the whole tensor (False)
-> (x_fp8 [M, K] float8_e4m3fn, scale float32 [M, 1] (per token) or [1] (per tensor))
scale = max(amax, 1e-12) / 448 over the row (or the whole tensor); x_fp8 = round(x / scale),
round-to-nearest-even onto the e4m3 grid, so x ~= x_fp8 * scale.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_nonempty_rows, check_tensor, row_count
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, TIE_RTOL, make_quantize_inputs, snapped_scale
from kiln.ops.gemm.shapes import fuzz_quantize_shapes, quantize_bytes, quantize_flops
from kiln.ops.registry import OpSpec, define_op


def quantize_fp8_reference(x, per_token=True):
    # defined in float32, as every backend runs it (inputs up to float32 are exact there): a quotient
    # on a rounding tie between two e4m3 values, common with fp16 / bf16 inputs, rounds as in float32
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax().reshape(1)
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


# Every finite e4m3fn value, ascending (float64): the grid a code must lie on.
E4M3_GRID = torch.unique(
    torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).to(torch.float64)
)
E4M3_GRID = E4M3_GRID[E4M3_GRID.isfinite()]


def verified_outputs(result, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) with the slack a correct kernel has taken out, as quantize_int8's: a scale within
    SCALE_RTOL of the exact max(amax, AMAX_FLOOR) / 448 becomes that value, and a code on either e4m3
    neighbour of an exact quotient x / scale lying within TIE_RTOL (relative) of their midpoint becomes
    the lower one. Run on the reference's result and the implementation's alike, so the tolerance is 0:
    any other code (a step off away from a tie, the old 1e-2 norm bound and one step per element let
    through) or a scale off by more fails."""
    codes, scale = result
    x = inputs["x"].detach().to(device="cpu", dtype=torch.float64)
    amax = x.abs().amax(dim=-1, keepdim=True) if inputs["per_token"] else x.abs().amax().reshape(1)
    exact_scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    exact = (x / exact_scale).clamp(-FP8_MAX, FP8_MAX)
    index = torch.searchsorted(E4M3_GRID, exact.contiguous()).clamp(1, len(E4M3_GRID) - 1)
    low, high = E4M3_GRID[index - 1], E4M3_GRID[index]
    near_tie = (exact - (low + high) / 2).abs() <= TIE_RTOL * exact.abs()
    got_codes = codes.detach().to(device="cpu", dtype=torch.float64)
    snap_code = near_tie & ((got_codes == low) | (got_codes == high))
    return (
        torch.where(snap_code, low, got_codes).to(device=codes.device, dtype=codes.dtype),
        snapped_scale(scale, exact_scale),
    )


def validate_quantize_fp8(x, per_token) -> None:
    check_tensor("quantize_fp8", "x", x, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,))
    check_nonempty_rows("quantize_fp8", x)


def _fake(x, per_token):
    scale_shape = (x.shape[0], 1) if per_token else (1,)
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(scale_shape, dtype=torch.float32)


def _make_inputs(shape, dtype, device, generator):
    return {**make_quantize_inputs(shape, dtype, device, generator), "per_token": shape["per_token"]}


def _fuzz_shapes(rng):
    return [{**s, "per_token": per} for s in fuzz_quantize_shapes(rng) for per in (True, False)]


QUANTIZE_FP8 = OpSpec(
    name="quantize_fp8",
    description="fused amax + scale + cast to float8_e4m3fn, per token or per tensor",
    reference=quantize_fp8_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # exact: verified_outputs takes out the float32 rounding of a correct kernel (and XLA's reciprocal
    # product, which put quotients sitting on e4m3 ties on the other neighbour) first
    tolerance={torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0},
    flops=quantize_flops,
    bytes=quantize_bytes,
    outputs=verified_outputs,
    bench_shapes={
        "llm": [{"M": m, "K": k, "per_token": True} for k in (4096, 14336, 576) for m in (1, 64, 2048, 8192)]
    },
    schema="(Tensor x, bool per_token=True) -> (Tensor, Tensor)",
    validate=validate_quantize_fp8,
    fake=_fake,
    call_case=lambda x, per_token: ({"M": row_count(x), "K": x.shape[-1], "per_token": per_token}, x.dtype),
    doc=__doc__,
)

quantize_fp8 = define_op(QUANTIZE_FP8, "kiln.ops")
