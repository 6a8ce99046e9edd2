import random

import pytest
import torch

import kiln.ops
from kiln.ops.gemm.linear_silu_mul import LINEAR_SILU_MUL
from kiln.ops.gemm.linear_silu_mul.triton import linear_silu_mul_triton
from kiln.verify import assert_close, run_case


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [{"M": 1, "N": 37, "K": 200}, {"M": 19, "N": 21, "K": 65}])
def test_linear_silu_mul_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(LINEAR_SILU_MUL, backend, shape, dtype, device, seed())
    assert case.passed, case


def test_linear_silu_mul_split_k_keeps_gate_and_up_apart(device):
    x = torch.randn(5, 90, device=device)
    w = torch.randn(2 * 24, 90, device=device) / 10
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "SPLIT_K": 4,
              "num_warps": 4, "num_stages": 2}  # fmt: skip
    out = linear_silu_mul_triton(x, w, config=config)
    gate, up = x.double() @ w[:24].double().T, x.double() @ w[24:].double().T
    assert_close(out, torch.nn.functional.silu(gate) * up, 1e-5)


def test_linear_silu_mul_rejects_odd_gate_up_rows():
    with pytest.raises(ValueError, match="expected an even 2N"):
        kiln.ops.linear_silu_mul(torch.randn(2, 8), torch.randn(7, 8))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [{"M": 1, "N": 4096, "K": 4096}, {"M": 300, "N": 577, "K": 1000, "bias": True}]
)
def test_linear_silu_mul_bfloat16_on_gpu(shape):
    case = run_case(LINEAR_SILU_MUL, "triton", shape, torch.bfloat16, torch.device("cuda"), seed())
    assert case.passed, case
