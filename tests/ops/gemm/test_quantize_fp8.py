import dataclasses

import pytest
import torch

from kiln.ops.gemm.quantize_fp8 import QUANTIZE_FP8
from kiln.ops.gemm.quantize_fp8.triton import quantize_fp8_triton
from kiln.ops.gemm.scaled import AMAX_FLOOR, FP8_MAX
from kiln.ops.registry import Implementation
from kiln.verify import assert_close, run_case
from tests.ops.gemm.scaled_gemm_cases import seed

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [{"M": 1, "K": 1}, {"M": 5, "K": 333}, {"M": 3, "K": 5000}])
@pytest.mark.parametrize("per_token", [True, False])
def test_quantize_fp8_matches_float64_reference(backend, dtype, shape, per_token, device):
    case = run_case(QUANTIZE_FP8, backend, {**shape, "per_token": per_token}, dtype, device, seed())
    assert case.passed, case


def test_quantize_fp8_rounds_to_nearest_even_like_torch_cast(device):
    # Values that round up into the next binade (31.6 -> 32), ties, subnormals and the saturation edge.
    special = torch.tensor([31.6, -126.3, 1.0625, 1.1875, 0.0015, -0.0024, 0.0, 447.0])
    generator = torch.Generator().manual_seed(seed())
    x = torch.cat([special, torch.randn(4000, generator=generator) * 50]).reshape(2, -1)
    x[:, 0] = 448.0  # amax = 448 so scale = 1 and the special values are cast as they are
    q, scale = quantize_fp8_triton(x.to(device), per_token=True)
    assert torch.equal(scale.cpu(), torch.ones(2, 1))
    expected = (x / scale.cpu()).clamp(-448, 448).to(FP8)
    # Compared as values, not bytes: a tiny negative that underflows is -0 in torch's cast but +0 under the
    # Triton interpreter; both are the same number, and every nonzero code must match exactly.
    assert torch.equal(q.cpu().float(), expected.float())
    nonzero = expected.float() != 0
    assert torch.equal(q.cpu().view(torch.uint8)[nonzero], expected.view(torch.uint8)[nonzero])


def test_quantize_fp8_per_tensor_uses_global_amax(device):
    x = torch.randn(6, 40, device=device)
    x[4, 7] = -900.0
    q, scale = quantize_fp8_triton(x, per_token=False)
    assert scale.shape == (1,) and scale.item() == pytest.approx(900.0 / 448.0, rel=1e-6)
    assert q[4, 7].float().item() == -448.0
    assert_close(q.float() * scale, x, 0.08)  # e4m3 keeps 3 mantissa bits: <= 2^-4 relative per element


def _planted(fn):
    spec = dataclasses.replace(QUANTIZE_FP8, implementations={})
    spec.register(Implementation("planted", fn))
    return spec


def _quantize(x, per_token=True, scale_of=lambda scale: scale, step_every=0):
    """A plain quantize_fp8 with a planted bug: the scale through `scale_of` (the codes follow it), or
    every `step_every`-th code moved to its next e4m3 value away from zero."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax().reshape(1)
    scale = scale_of(amax.clamp(min=AMAX_FLOOR) / FP8_MAX)
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if step_every:
        flat = codes.view(-1)
        bits = flat[::step_every].view(torch.uint8)
        magnitude = bits & 0x7F
        bumped = torch.where((magnitude > 0) & (magnitude < 0x7E), bits + 1, bits)  # not 0, not past 448
        flat[::step_every] = bumped.view(FP8)
    return codes, scale


@pytest.mark.parametrize(
    "bug",
    [
        lambda x, per_token: _quantize(x, per_token, scale_of=lambda scale: scale.half().float()),
        lambda x, per_token: _quantize(x, per_token, scale_of=lambda scale: scale * 1.001),
        lambda x, per_token: _quantize(x, per_token, step_every=50),
    ],
    ids=["float16_scale", "scale_0.1%_large", "every_50th_code_one_step_off"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verifier_holds_fp8_scale_and_codes_exact(bug, dtype):
    """Each passed the old bounds (1e-2 in norm, one e4m3 step per element)."""
    shape = {"M": 5, "K": 333, "per_token": True}
    case = run_case(_planted(bug), "planted", shape, dtype, torch.device("cpu"), seed())
    assert not case.passed, case


def test_verifier_allows_either_neighbour_at_an_e4m3_tie():
    """x / scale exactly halfway between two e4m3 values (17 between 16 and 18, at scale 1): the lower
    or the upper neighbour both pass, a code a step further (20) does not."""
    x = torch.tensor([[448.0, 17.0, -17.0, 0.75]])
    scale = torch.tensor([[1.0]])
    inputs = {"x": x, "per_token": True}

    def same(got, expected):
        return all(torch.equal(g.float(), e.float()) for g, e in zip(got, expected, strict=True))

    expected = QUANTIZE_FP8.output_tensors(QUANTIZE_FP8.reference(x.double()), {**inputs, "x": x.double()})
    for seventeen in (16.0, 18.0):
        codes = torch.tensor([[448.0, seventeen, -seventeen, 0.75]]).to(FP8)
        assert same(QUANTIZE_FP8.output_tensors((codes, scale), inputs), expected)
    codes = torch.tensor([[448.0, 20.0, -17.0, 0.75]]).to(FP8)
    assert not same(QUANTIZE_FP8.output_tensors((codes, scale), inputs), expected)
