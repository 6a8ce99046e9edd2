"""fused_linear_cross_entropy's XLA backend (chunks of tokens in a lax.scan) against float64: loss and
the three gradients, with ignored tokens, label smoothing, z-loss and both reductions."""

import random

import pytest
import torch

pytest.importorskip("jax")

from kiln.ops import get_op  # noqa: E402
from kiln.verify import run_case  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 37, "hidden": 24, "vocab": 301, "ignored": True},  # several chunks
        {"tokens": 19, "hidden": 16, "vocab": 517, "label_smoothing": 0.1, "bias": True},
        {"tokens": 23, "hidden": 32, "vocab": 129, "z_loss": 1e-4, "reduction": "sum", "ignored": True},
    ],
)
def test_fused_linear_cross_entropy_xla_matches_float64(shape, dtype):
    op = get_op("fused_linear_cross_entropy")
    case = run_case(op, "xla", shape, dtype, torch.device("cpu"), seed=random.randrange(2**31))
    assert case.passed, case
