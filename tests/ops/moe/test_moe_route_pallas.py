"""moe_route's JAX backends (the Mosaic TPU kernel in the TPU interpreter, the Pallas Triton kernel in
the Pallas interpreter, XLA's top_k) against float64; the kernels' expert ids equal XLA's exactly,
ties and non-finite logits included; their Mosaic / Triton lowering; kiln.jax.moe_route."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.moe.moe_route.pallas_gpu import moe_route_pallas_gpu  # noqa: E402
from kiln.ops.moe.moe_route.pallas_tpu import moe_route_pallas_tpu  # noqa: E402
from kiln.ops.moe.moe_route.xla import moe_route_xla  # noqa: E402
from kiln.verify import run_case  # noqa: E402

KERNELS = {"pallas_tpu": moe_route_pallas_tpu, "pallas_gpu": moe_route_pallas_gpu}


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 37, "experts": 60, "top_k": 4, "renormalize": False},
        {"tokens": 6, "experts": 256, "top_k": 8, "scoring": "sigmoid"},
    ],
)
def test_moe_route_jax_backends_match_float64(backend, shape):
    case = run_case(get_op("moe_route"), backend, shape, torch.bfloat16, torch.device("cpu"), seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 9, "experts": 3, "top_k": 3},  # every expert chosen
        {"tokens": 1, "experts": 7, "top_k": 1, "scoring": "sigmoid", "renormalize": False},
        {"tokens": 70, "experts": 65, "top_k": 5},  # two token blocks; experts just past a power of two
    ],
)
def test_moe_route_pallas_gpu_matches_float64(shape, dtype):
    case = run_case(get_op("moe_route"), "pallas_gpu", shape, dtype, torch.device("cpu"), seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize(
    "top_k, experts, scoring, renormalize, dtype",
    [
        (1, 60, "softmax", True, jnp.float32),
        (2, 130, "sigmoid", False, jnp.bfloat16),  # two lane tiles of experts
        (8, 200, "softmax", False, jnp.bfloat16),
        (20, 60, "softmax", True, jnp.bfloat16),  # past 8 rounds the kernel loops instead of unrolling
    ],
)
def test_moe_route_pallas_ids_equal_xla_on_random_logits(kernel, top_k, experts, scoring, renormalize, dtype):
    """Odd token count, experts not a multiple of 128 (nor a power of two); bf16 logits rounded to a
    coarse grid, so many rows hold equal logits and the tie order (lower expert id first) is exercised."""
    rng = np.random.default_rng(seed())
    logits = rng.standard_normal((37, experts)).astype(np.float32)
    logits[::2] = np.round(logits[::2] * 2) / 2  # every other row: values on a 0.5 grid, many ties
    logits = jnp.asarray(logits).astype(dtype)
    weights, ids = KERNELS[kernel](logits, top_k, renormalize, scoring)
    want_weights, want_ids = moe_route_xla(logits, top_k, renormalize, scoring)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    assert np.array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_moe_route_pallas_ranks_non_finite_and_signed_zero_logits_as_lax_top_k(kernel):
    """IEEE total order, as lax.top_k: +NaN above +inf, -NaN below -inf, +0 above -0; equal values go
    to the lower id."""
    nan = np.float32("nan")
    logits = np.array(
        [
            [1.0, nan, 3.0, 3.0, -np.inf],
            [-np.inf, -np.inf, 0.0, -np.inf, -np.inf],
            [np.inf, 1.0, np.inf, nan, 0.0],
            [-0.0, 0.0, -nan, 2.0, -0.0],
        ],
        np.float32,
    )
    logits[3, 2] = np.copysign(nan, -1.0)
    x = jnp.asarray(logits)
    ids = KERNELS[kernel](x, 5)[1]
    assert np.array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(x, 5)[1]))
    assert ids.tolist()[3] == [3, 1, 0, 4, 2]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_moe_route_pallas_on_zero_tokens_returns_empty_outputs(kernel):
    weights, ids = KERNELS[kernel](jnp.ones((0, 8), jnp.bfloat16), 2)
    assert weights.shape == ids.shape == (0, 2)


def test_moe_route_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    for dtype, top_k, scoring in (
        (jnp.bfloat16, 2, "softmax"),
        (jnp.float32, 8, "sigmoid"),
        (jnp.float32, 20, "softmax"),
    ):
        logits = jnp.ones((11, 60), dtype)
        lower_for_tpu(
            lambda x, k=top_k, s=scoring: moe_route_pallas_tpu(x, k, True, s, interpret=False), logits
        )


def test_moe_route_gpu_kernel_lowers_to_triton(lower_for_gpu):
    """Past the lowering test's fuzz shapes: the looped rounds (k = 20), 256 experts, f32 and f16."""
    for dtype, top_k, experts, scoring in (
        (jnp.float16, 20, 60, "softmax"),
        (jnp.float32, 8, 256, "sigmoid"),
    ):
        logits = jnp.ones((11, experts), dtype)
        lower_for_gpu(
            lambda x, k=top_k, s=scoring: moe_route_pallas_gpu(x, k, True, s, interpret=False), logits
        )


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu", "xla"])
def test_kiln_jax_moe_route_under_jit(implementation):
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]])
    weights, ids = jax.jit(lambda a: kjax.moe_route(a, 2, implementation=implementation))(logits)
    assert ids.tolist() == [[1, 3], [0, 2]]
    assert jnp.allclose(weights.sum(-1), 1.0)
