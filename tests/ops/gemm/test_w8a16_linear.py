"""The W8A16 linear spec (kiln.ops.w8a16_linear): its CPU path against the float64 reference and its
argument errors. Needs no jax (the spec is a torch op; its JAX backends: test_w8a16_linear_pallas.py)."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops import get_op
from kiln.ops.gemm.w8a16_linear import quantize_weight_int8
from kiln.verify import assert_close, run_case

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_cpu_path_matches_float64(dtype):
    rng = random.Random(7)
    for shape in get_op("w8a16_linear").fuzz_shapes(rng):
        case = run_case(get_op("w8a16_linear"), "cpu", shape, dtype, CPU, seed=rng.randrange(2**31))
        assert case.passed, case


def test_w8a16_public_op_handles_3d_input_and_matches_dequantized_linear():
    w, scale = quantize_weight_int8(torch.randn(48, 64))
    x = torch.randn(2, 3, 64)
    out = kiln.ops.w8a16_linear(x, w, scale)
    assert out.shape == (2, 3, 48)
    assert_close(out, x @ (w.float() * scale).T, 1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: kiln.ops.w8a16_linear(torch.randn(2, 8), torch.ones(4, 8), torch.ones(4, 1)),
            "w8a16_linear: weight has dtype float32",
        ),
        (
            lambda: kiln.ops.w8a16_linear(
                torch.randn(2, 8), torch.ones(4, 8, dtype=torch.int8), torch.ones(3)
            ),
            "weight_scale has shape",
        ),
        (
            lambda: kiln.ops.w8a16_linear(
                torch.randn(2, 8), torch.ones(4, 9, dtype=torch.int8), torch.ones(4)
            ),
            "weight has last dim 9",
        ),
        (
            lambda: kiln.ops.w8a16_linear(
                torch.randn(2, 8),
                torch.ones(4, 8, dtype=torch.int8),
                torch.ones(4),
                torch.ones(4, dtype=torch.float16),
            ),
            "must share one dtype",
        ),
    ],
)
def test_w8a16_linear_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
