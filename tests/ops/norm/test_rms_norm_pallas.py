import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.norm.rms_norm.pallas_tpu import rms_norm_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"rows": 1, "hidden": 1},
        {"rows": 7, "hidden": 576, "residual": True},  # rows padded to the sublane tile
        {"rows": 37, "hidden": 1000},  # hidden not a lane multiple: full-dim block
        {"rows": 9, "hidden": 256, "residual": True, "offset": True},  # Gemma's (1 + weight)
    ],
)
def test_rms_norm_jax_backends_match_float64_reference(backend, dtype, shape):
    case = run_case(get_op("rms_norm"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


def test_rms_norm_pallas_tpu_fp16_many_row_blocks():
    # 600 rows of 2000: more rows than one block holds, so the grid has several steps.
    shape = {"rows": 600, "hidden": 2000}
    case = run_case(get_op("rms_norm"), "pallas_tpu", shape, torch.float16, CPU, seed=3)
    assert case.passed, case


def test_rms_norm_torch_adapter_updates_residual_in_place():
    x, residual, weight = torch.randn(5, 129), torch.randn(5, 129), torch.rand(129) + 0.5
    expected_sum = x + residual
    out, new_residual = get_op("rms_norm").implementation("pallas_tpu").fn(x, weight, 1e-5, residual)
    assert new_residual is residual
    torch.testing.assert_close(residual, expected_sum)
    ref = expected_sum * torch.rsqrt(expected_sum.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_kiln_jax_runs_under_jit_with_3d_input():
    x = jax.random.normal(jax.random.key(0), (2, 3, 200), jnp.float32)
    w = jax.random.uniform(jax.random.key(1), (200,), jnp.float32) + 0.5
    got = jax.jit(lambda a, b: kjax.rms_norm(a, b, implementation="pallas_tpu"))(x, w)
    ref = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w
    assert got.shape == x.shape
    assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 1e-5


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (jnp.ones((2, 8)), jnp.ones((7,))), "weight has last dim 7, expected x's hidden size 8"),
        (lambda: (jnp.ones((2, 8)), jnp.ones((8,), jnp.float16)), "must share one dtype"),
        (lambda: (jnp.ones((2, 8), jnp.int32), jnp.ones((8,))), "x has dtype int32"),
        (lambda: (jnp.ones((2, 8)), jnp.ones((2, 8))), "weight must have 1 dims"),
    ],
)
def test_rms_norm_kiln_jax_rejects_bad_input(make, message):
    x, weight = make()
    with pytest.raises(ValueError, match=message):
        kjax.rms_norm(x, weight)


def test_rms_norm_rejects_unknown_implementation():
    with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
        kjax.rms_norm(jnp.ones((2, 8)), jnp.ones((8,)), implementation="cuda")


def test_rms_norm_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x = jnp.ones((13, 576), jnp.bfloat16)
    w = jnp.ones((576,), x.dtype)
    lower_for_tpu(lambda a, r, w: rms_norm_pallas_tpu(a, w, 1e-6, r, interpret=False), x, x, w)
