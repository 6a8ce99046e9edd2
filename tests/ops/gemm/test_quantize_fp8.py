import pytest
import torch

from kiln.ops.gemm.quantize_fp8 import QUANTIZE_FP8
from kiln.ops.gemm.quantize_fp8.triton import quantize_fp8_triton
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
