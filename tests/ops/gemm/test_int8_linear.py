import pytest
import torch

import kiln.ops
from kiln.ops.gemm.int8_linear import INT8_LINEAR
from kiln.ops.gemm.int8_linear.triton import int8_linear_triton
from kiln.verify import assert_close, run_case
from tests.ops.gemm.scaled_gemm_cases import SCALED_LINEAR_SHAPES, seed


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SCALED_LINEAR_SHAPES)
def test_int8_linear_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(INT8_LINEAR, backend, shape, dtype, device, seed())
    assert case.passed, case


def test_int8_linear_accumulates_exactly_in_int32_beyond_float16_range(device):
    # Every product is 127 * 127, summed 1000 times: 16,129,000 needs int32 (fp16 would overflow).
    x = torch.full((2, 1000), 127, dtype=torch.int8, device=device)
    w = torch.full((3, 1000), 127, dtype=torch.int8, device=device)
    w[1] = -127
    ones = torch.ones(2, 1, device=device)
    out = int8_linear_triton(x, ones, w, torch.ones(3, 1, device=device), out_dtype=torch.float32)
    assert out.tolist() == [[16129000.0, -16129000.0, 16129000.0]] * 2


def test_int8_linear_split_k_end_to_end_with_quantize(device):
    x = torch.randn(5, 130, device=device)
    w = torch.randn(21, 130, device=device) / 11
    bias = torch.randn(21, device=device)
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
