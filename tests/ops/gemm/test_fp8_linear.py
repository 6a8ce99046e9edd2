import pytest
import torch

import kiln.ops
from kiln.ops.gemm.fp8_linear import FP8_LINEAR
from kiln.ops.gemm.fp8_linear.triton import fp8_linear_triton
from kiln.verify import assert_close, run_case
from tests.ops.gemm.scaled_gemm_cases import SCALED_LINEAR_SHAPES, seed

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SCALED_LINEAR_SHAPES)
def test_fp8_linear_matches_float64_reference_on_quantized_inputs(backend, dtype, shape, device):
    case = run_case(FP8_LINEAR, backend, shape, dtype, device, seed())
    assert case.passed, case


def test_fp8_linear_split_k_with_per_token_scales_and_bias(device):
    x = torch.randn(3, 150, device=device)
    w = torch.randn(20, 150, device=device) / 12
    bias = torch.randn(20, device=device)
    x_fp8, x_scale = kiln.ops.quantize_fp8(x)
    w_fp8, w_scale = kiln.ops.quantize_fp8(w)  # per row of W = per output channel
    config = {
        "BLOCK_M": 16,
        "BLOCK_N": 16,
        "BLOCK_K": 32,
        "GROUP_M": 8,
        "SPLIT_K": 3,
        "num_warps": 4,
        "num_stages": 2,
    }
    out = fp8_linear_triton(x_fp8, x_scale, w_fp8, w_scale, bias, torch.float32, config=config)
    exact = (x_fp8.double() * x_scale.double()) @ (w_fp8.double() * w_scale.double()).T + bias.double()
    assert_close(out, exact, 1e-5)
    assert_close(out, x @ w.T + bias, 0.1)  # and the whole fp8 pipeline stays near the float product


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (torch.randn(2, 8), torch.ones(2, 1), torch.randn(4, 8).to(FP8), torch.ones(4, 1)),
            "x has dtype float32",
        ),
        (
            (torch.randn(2, 8).to(FP8), torch.ones(3, 1), torch.randn(4, 8).to(FP8), torch.ones(4, 1)),
            "x_scale has shape",
        ),
        (
            (torch.randn(2, 8).to(FP8), torch.ones(2, 1), torch.randn(4, 9).to(FP8), torch.ones(4, 1)),
            "9 in-features",
        ),
        (
            (torch.randn(2, 8).to(FP8), torch.ones(2, 1), torch.randn(4, 8).to(FP8), torch.ones(4, 2)),
            "w_scale has shape",
        ),
    ],
)
def test_fp8_linear_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.fp8_linear(*args)


def test_fp8_linear_rejects_integer_out_dtype():
    x = torch.randn(2, 8).to(FP8)
    with pytest.raises(ValueError, match="out_dtype"):
        kiln.ops.fp8_linear(x, torch.ones(2, 1), x, torch.ones(2, 1), out_dtype=torch.int32)


def test_fp8_linear_out_dtype_defaults_to_bfloat16():
    x = torch.randn(2, 8).to(FP8)
    assert kiln.ops.fp8_linear(x, torch.ones(2, 1), x, torch.ones(2, 1)).dtype == torch.bfloat16


@pytest.mark.gpu
def test_fp8_linear_bfloat16_out_on_gpu_matches_scaled_mm():
    case = run_case(FP8_LINEAR, "triton", {"M": 300, "N": 512, "K": 1024, "per_token": True}, torch.bfloat16,
                    torch.device("cuda"), seed())  # fmt: skip
    assert case.passed, case
    inputs = FP8_LINEAR.make_inputs({"M": 64, "N": 256, "K": 512, "per_token": False}, torch.bfloat16,
                                    torch.device("cuda"), torch.Generator().manual_seed(0))  # fmt: skip
    assert_close(fp8_linear_triton(**inputs), FP8_LINEAR.baselines["torch_scaled_mm"](**inputs), 2e-2)
