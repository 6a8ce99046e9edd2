import pytest
import torch

import kiln.ops
from kiln.ops.gemm.fp8_spec import FP8_LINEAR, QUANTIZE_FP8
from kiln.ops.gemm.scaled_triton import fp8_linear_triton, quantize_fp8_triton
from kiln.verify import assert_close, run_case
from tests.ops.scaled_gemm_cases import SCALED_LINEAR_SHAPES, seed

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [{"M": 1, "K": 1}, {"M": 5, "K": 333}, {"M": 3, "K": 5000}])
@pytest.mark.parametrize("per_token", [True, False])
def test_quantize_fp8_matches_float64_reference(backend, dtype, shape, per_token, device):
    case = run_case(QUANTIZE_FP8, backend, {**shape, "per_token": per_token}, dtype, device, seed())
    assert case.passed, case


def test_quantize_fp8_rounds_to_nearest_even_like_torch_cast():
    # Values that round up into the next binade (31.6 -> 32), ties, subnormals and the saturation edge.
    special = torch.tensor([31.6, -126.3, 1.0625, 1.1875, 0.0015, -0.0024, 0.0, 447.0])
    x = torch.cat([special, torch.randn(500) * 50]).reshape(2, -1)
    x[:, 0] = 448.0  # amax = 448 so scale = 1 and the special values are cast as they are
    q, scale = quantize_fp8_triton(x, per_token=True)
    assert torch.equal(scale, torch.ones(2, 1))
    expected = (x / scale).clamp(-448, 448).to(FP8)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


def test_quantize_fp8_per_tensor_uses_global_amax():
    x = torch.randn(6, 40)
    x[4, 7] = -900.0
    q, scale = quantize_fp8_triton(x, per_token=False)
    assert scale.shape == (1,) and scale.item() == pytest.approx(900.0 / 448.0, rel=1e-6)
    assert q[4, 7].float().item() == -448.0
    assert_close(q.float() * scale, x, 0.08)  # e4m3 keeps 3 mantissa bits: <= 2^-4 relative per element


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SCALED_LINEAR_SHAPES)
def test_fp8_linear_matches_float64_reference_on_quantized_inputs(backend, dtype, shape, device):
    case = run_case(FP8_LINEAR, backend, shape, dtype, device, seed())
    assert case.passed, case


def test_fp8_linear_split_k_with_per_token_scales_and_bias():
    x = torch.randn(3, 150)
    w = torch.randn(20, 150) / 12
    bias = torch.randn(20)
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


@pytest.mark.gpu
def test_fp8_linear_bfloat16_out_on_gpu_matches_scaled_mm():
    case = run_case(FP8_LINEAR, "triton", {"M": 300, "N": 512, "K": 1024, "per_token": True}, torch.bfloat16,
                    torch.device("cuda"), seed())  # fmt: skip
    assert case.passed, case
    inputs = FP8_LINEAR.make_inputs({"M": 64, "N": 256, "K": 512, "per_token": False}, torch.bfloat16,
                                    torch.device("cuda"), torch.Generator().manual_seed(0))  # fmt: skip
    assert_close(fp8_linear_triton(**inputs), FP8_LINEAR.baselines["torch_scaled_mm"](**inputs), 2e-2)
