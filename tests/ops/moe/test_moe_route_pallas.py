"""moe_route's XLA backend (top-k + softmax / sigmoid + renormalize) against float64; kiln.jax.moe_route."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.verify import run_case  # noqa: E402


@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 37, "experts": 60, "top_k": 4, "renormalize": False},
        {"tokens": 6, "experts": 256, "top_k": 8, "scoring": "sigmoid"},
    ],
)
def test_moe_route_xla_matches_float64(shape):
    case = run_case(
        get_op("moe_route"), "xla", shape, torch.bfloat16, torch.device("cpu"), seed=random.randrange(2**31)
    )
    assert case.passed, case


def test_kiln_jax_moe_route_under_jit():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]])
    weights, ids = jax.jit(lambda a: kjax.moe_route(a, 2))(logits)
    assert ids.tolist() == [[1, 3], [0, 2]]
    assert jnp.allclose(weights.sum(-1), 1.0)
