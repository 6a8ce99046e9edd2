"""gguf_linear's XLA backend (the jax.numpy block decoder, then the GEMM) against float64."""

import random

import pytest
import torch

pytest.importorskip("jax")

from kiln.ops import get_op  # noqa: E402
from kiln.verify import run_case  # noqa: E402


@pytest.mark.parametrize(
    "shape",
    [
        {"M": 3, "N": 45, "K": 160, "qtype": "Q4_1", "bias": True},
        {"M": 1, "N": 37, "K": 512, "qtype": "Q4_K"},
        {"M": 9, "N": 19, "K": 256, "qtype": "Q5_0"},
    ],
)
def test_gguf_linear_xla_matches_float64(shape):
    case = run_case(
        get_op("gguf_linear"), "xla", shape, torch.float16, torch.device("cpu"), random.randrange(2**31)
    )
    assert case.passed, case
