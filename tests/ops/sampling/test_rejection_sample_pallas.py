"""rejection_sample's XLA backend against the float64 reference (integer outputs: exact)."""

import random

import pytest
import torch

pytest.importorskip("jax")

from kiln.ops import get_op  # noqa: E402
from kiln.verify import run_case  # noqa: E402


@pytest.mark.parametrize(
    "shape",
    [
        {"batch": 9, "num_draft": 5, "vocab": 1000, "draft_probs": True},
        {"batch": 5, "num_draft": 3, "vocab": 333},
        {"batch": 1, "num_draft": 1, "vocab": 1},
    ],
)
def test_rejection_sample_xla_matches_float64(shape):
    case = run_case(
        get_op("rejection_sample"), "xla", shape, torch.float32, torch.device("cpu"), random.randrange(2**31)
    )
    assert case.passed, case
