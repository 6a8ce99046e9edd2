import dataclasses

import pytest
import torch

from kiln.ops.gemm.quantize_int8 import QUANTIZE_INT8
from kiln.ops.gemm.quantize_int8.spec import round_half_away
from kiln.ops.gemm.quantize_int8.triton import quantize_int8_triton
from kiln.ops.gemm.scaled import AMAX_FLOOR, INT8_MAX
from kiln.ops.registry import Implementation
from kiln.verify import run_case
from tests.ops.gemm.scaled_gemm_cases import seed


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [{"M": 1, "K": 1}, {"M": 5, "K": 333}, {"M": 3, "K": 5000}])
def test_quantize_int8_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(QUANTIZE_INT8, backend, shape, dtype, device, seed())
    assert case.passed, case


def test_quantize_int8_rounds_half_away_from_zero_per_row(device):
    # amax 127 -> scale 1: the values are rounded as they are.
    x = torch.tensor([[127.0, 2.5, -2.5, 0.49, -0.51, 3.2, -126.6, 0.0], [1.0, -0.5, 0.25, 0.0, 0, 0, 0, 0]])
    q, scale = quantize_int8_triton(x.to(device))
    assert scale[0].item() == 1.0 and scale[1].item() == pytest.approx(1 / 127)
    assert q[0].tolist() == [127, 3, -3, 0, -1, 3, -127, 0]
    assert q[1].tolist() == [127, -64, 32, 0, 0, 0, 0, 0]  # -63.5 -> -64, 31.75 -> 32


def _planted(fn):
    spec = dataclasses.replace(QUANTIZE_INT8, implementations={})
    spec.register(Implementation("planted", fn))
    return spec


def _quantize(x, scale_of=lambda scale: scale, bump_every=0):
    """A plain quantize_int8 with a planted bug: the scale passed through `scale_of` (the codes follow
    it), or every `bump_every`-th code one step further from zero."""
    xf = x.float()
    scale = scale_of(xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR) / INT8_MAX)
    codes = round_half_away(xf / scale)
    if bump_every:
        codes.view(-1)[::bump_every] += codes.view(-1)[::bump_every].sign()
    return codes.clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


@pytest.mark.parametrize(
    "bug",
    [
        lambda x: _quantize(x, scale_of=lambda scale: scale.half().float()),  # scale stored in float16
        lambda x: _quantize(x, scale_of=lambda scale: scale * 1.001),
        lambda x: _quantize(x, bump_every=50),
    ],
    ids=["float16_scale", "scale_0.1%_large", "every_50th_code_one_step_off"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verifier_holds_scale_and_codes_exact(bug, dtype):
    # Each passed the one 5e-3 norm bound the codes and scale once shared.
    case = run_case(_planted(bug), "planted", {"M": 5, "K": 333}, dtype, torch.device("cpu"), seed())
    assert not case.passed, case


def test_verifier_allows_one_step_at_a_tie_and_a_scale_rounded_twice():
    # A kernel multiplying by 127 / amax (two roundings) may put a tie either side, and a scale of
    # amax * (1 / 127) is one float32 ulp from amax / 127 (for amax 9): both correct, both pass.
    x = torch.tensor([[127.0, 2.5, -2.5, 0.49, 100.3], [1.0, -0.5, 0.25, 0.0, 9.0]])
    half_even = torch.round(x * (INT8_MAX / x.abs().amax(dim=-1, keepdim=True)))  # ties to even: 2, -2
    scale = x.abs().amax(dim=-1, keepdim=True) * (1 / INT8_MAX)
    assert half_even[0, 1] == 2 and not torch.equal(scale, x.abs().amax(dim=-1, keepdim=True) / INT8_MAX)
    got = QUANTIZE_INT8.output_tensors((half_even.to(torch.int8), scale), {"x": x})
    expected = QUANTIZE_INT8.output_tensors(QUANTIZE_INT8.reference(x.double()), {"x": x.double()})
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    off_by_one = half_even.clone()
    off_by_one[0, 4] += 1  # 100.3 is no tie
    got = QUANTIZE_INT8.output_tensors((off_by_one.to(torch.int8), scale), {"x": x})
    assert not torch.equal(got[0], expected[0])
