import pytest
import torch

import kiln.ops
from kiln.ops.gemm.int8_spec import INT8_LINEAR, QUANTIZE_INT8
from kiln.ops.gemm.scaled_triton import int8_linear_triton, quantize_int8_triton
from kiln.verify import assert_close, run_case
from tests.ops.scaled_gemm_cases import SCALED_LINEAR_SHAPES, seed


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [{"M": 1, "K": 1}, {"M": 5, "K": 333}, {"M": 3, "K": 5000}])
def test_quantize_int8_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(QUANTIZE_INT8, backend, shape, dtype, device, seed())
    assert case.passed, case


def test_quantize_int8_rounds_half_away_from_zero_per_row():
    # amax 127 -> scale 1: the values are rounded as they are.
    x = torch.tensor([[127.0, 2.5, -2.5, 0.49, -0.51, 3.2, -126.6, 0.0], [1.0, -0.5, 0.25, 0.0, 0, 0, 0, 0]])
    q, scale = quantize_int8_triton(x)
    assert scale[0].item() == 1.0 and scale[1].item() == pytest.approx(1 / 127)
    assert q[0].tolist() == [127, 3, -3, 0, -1, 3, -127, 0]
    assert q[1].tolist() == [127, -64, 32, 0, 0, 0, 0, 0]  # -63.5 -> -64, 31.75 -> 32


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SCALED_LINEAR_SHAPES)
def test_int8_linear_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(INT8_LINEAR, backend, shape, dtype, device, seed())
    assert case.passed, case


def test_int8_linear_accumulates_exactly_in_int32_beyond_float16_range():
    # Every product is 127 * 127, summed 1000 times: 16,129,000 needs int32 (fp16 would overflow).
    x = torch.full((2, 1000), 127, dtype=torch.int8)
    w = torch.full((3, 1000), 127, dtype=torch.int8)
    w[1] = -127
    ones = torch.ones(2, 1)
    out = int8_linear_triton(x, ones, w, torch.ones(3, 1), out_dtype=torch.float32)
    assert out.tolist() == [[16129000.0, -16129000.0, 16129000.0]] * 2


def test_int8_linear_split_k_end_to_end_with_quantize():
    x, w, bias = torch.randn(5, 130), torch.randn(21, 130) / 11, torch.randn(21)
    x_q, x_scale = kiln.ops.quantize_int8(x)
    w_q, w_scale = kiln.ops.quantize_int8(w)
    config = {
        "BLOCK_M": 16,
        "BLOCK_N": 16,
        "BLOCK_K": 32,
        "GROUP_M": 8,
        "SPLIT_K": 4,
        "num_warps": 4,
        "num_stages": 2,
    }
    out = int8_linear_triton(x_q, x_scale, w_q, w_scale, bias, torch.float32, config=config)
    exact = (x_q.double() @ w_q.double().T) * x_scale.double() * w_scale.double().T + bias.double()
    assert_close(out, exact, 1e-6)
    assert_close(out, x @ w.T + bias, 0.02)


I8 = torch.int8


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(2, 8), torch.ones(2, 1), torch.ones(4, 8, dtype=I8), torch.ones(4, 1)), "x has dtype"),
        (
            (torch.ones(2, 8, dtype=I8), torch.ones(2, 1), torch.ones(4, 6, dtype=I8), torch.ones(4, 1)),
            "6 in-features",
        ),
        (
            (
                torch.ones(2, 8, dtype=I8),
                torch.ones(2, 1, dtype=torch.int32),
                torch.ones(4, 8, dtype=I8),
                torch.ones(4, 1),
            ),
            "x_scale has dtype int32",
        ),
    ],
)
def test_int8_linear_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.int8_linear(*args)


@pytest.mark.gpu
def test_int8_linear_bfloat16_on_gpu():
    case = run_case(INT8_LINEAR, "triton", {"M": 300, "N": 512, "K": 1024, "per_token": True}, torch.bfloat16,
                    torch.device("cuda"), seed())  # fmt: skip
    assert case.passed, case
