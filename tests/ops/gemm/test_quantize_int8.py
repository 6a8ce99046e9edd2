import pytest
import torch

from kiln.ops.gemm.quantize_int8 import QUANTIZE_INT8
from kiln.ops.gemm.quantize_int8.triton import quantize_int8_triton
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
