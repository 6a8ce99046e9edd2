"""sparse24_linear's XLA backend (the 2:4 weight expanded in jax.numpy) against float64."""

import random

import pytest
import torch

pytest.importorskip("jax")

from kiln.ops import get_op  # noqa: E402
from kiln.verify import run_case  # noqa: E402


@pytest.mark.parametrize("shape", [{"M": 1, "N": 37, "K": 4}, {"M": 17, "N": 33, "K": 204, "bias": True}])
def test_sparse24_linear_xla_matches_float64(shape):
    case = run_case(
        get_op("sparse24_linear"), "xla", shape, torch.bfloat16, torch.device("cpu"), random.randrange(2**31)
    )
    assert case.passed, case
