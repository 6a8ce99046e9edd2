"""layer_norm's JAX backends (TPU interpreter, Pallas GPU interpreter, XLA) against the spec's float64
reference, kiln.jax.layer_norm, and the TPU kernel's Mosaic lowering."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.norm.layer_norm.pallas_tpu import layer_norm_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"rows": 1, "hidden": 2},
        {"rows": 7, "hidden": 576},  # rows padded to the sublane tile
        {"rows": 37, "hidden": 1000, "bias": False},  # hidden not a lane multiple / power of two
    ],
)
def test_layer_norm_jax_backends_match_float64_reference(backend, dtype, shape):
    # The spec's inputs put a large per-row offset on x: a kernel with E[x^2] - E[x]^2 fails here.
    case = run_case(get_op("layer_norm"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


def test_layer_norm_pallas_tpu_fp16_many_row_blocks():
    # 600 rows of 2000: more rows than one block holds, so the grid has several steps.
    shape = {"rows": 600, "hidden": 2000}
    case = run_case(get_op("layer_norm"), "pallas_tpu", shape, torch.float16, CPU, seed=3)
    assert case.passed, case


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu", "xla"])
def test_layer_norm_kiln_jax_runs_under_jit_with_3d_input(implementation):
    x = jax.random.normal(jax.random.key(0), (2, 3, 200), jnp.float32) + 5.0
    w = jax.random.uniform(jax.random.key(1), (200,), jnp.float32) + 0.5
    b = jax.random.normal(jax.random.key(2), (200,), jnp.float32)
    got = jax.jit(lambda a, c, d: kjax.layer_norm(a, c, d, implementation=implementation))(x, w, b)
    mean = jnp.mean(x, -1, keepdims=True)
    ref = (x - mean) * jax.lax.rsqrt(jnp.mean((x - mean) ** 2, -1, keepdims=True) + 1e-5) * w + b
    assert got.shape == x.shape
    assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 1e-5


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: (jnp.ones((2, 8)), jnp.ones((7,)), None),
            "weight has last dim 7, expected x's hidden size 8",
        ),
        (lambda: (jnp.ones((2, 8)), jnp.ones((8,)), jnp.ones((8,), jnp.float16)), "must share one dtype"),
        (lambda: (jnp.ones((2, 8)), jnp.ones((8,)), jnp.ones((9,))), "bias has last dim 9"),
    ],
)
def test_layer_norm_kiln_jax_rejects_bad_input(make, message):
    x, weight, bias = make()
    with pytest.raises(ValueError, match=message):
        kjax.layer_norm(x, weight, bias)


def test_layer_norm_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x = jnp.ones((13, 576), jnp.bfloat16)
    w = jnp.ones((576,), x.dtype)
    lower_for_tpu(lambda a, w, b: layer_norm_pallas_tpu(a, w, b, 1e-5, interpret=False), x, w, w)
    lower_for_tpu(lambda a, w: layer_norm_pallas_tpu(a, w, None, 1e-5, interpret=False), x, w)
