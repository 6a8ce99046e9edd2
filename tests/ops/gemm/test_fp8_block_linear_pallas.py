"""fp8_block_linear's XLA backend (x quantized per token and group in jax.numpy) against float64."""

import random

import pytest
import torch

pytest.importorskip("jax")

from kiln.ops import get_op  # noqa: E402
from kiln.verify import run_case  # noqa: E402


@pytest.mark.parametrize(
    "shape",
    [{"M": 5, "N": 130, "K": 257, "bias": True}, {"M": 33, "N": 40, "K": 96, "block_n": 16, "block_k": 32}],
)
def test_fp8_block_linear_xla_matches_float64(shape):
    op = get_op("fp8_block_linear")
    case = run_case(op, "xla", shape, torch.bfloat16, torch.device("cpu"), seed=random.randrange(2**31))
    assert case.passed, case
