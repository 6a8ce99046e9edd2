"""silu_and_mul's JAX backends (TPU interpreter, Pallas interpreter, XLA) against float64, through
kiln.jax.silu_and_mul and through the torch spec."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.activation.silu_and_mul.pallas_tpu import silu_and_mul_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

# fp32: summation order only; bf16: one output rounding (2^-8 relative) plus bf16 inputs.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.6e-2}
BACKENDS = ["pallas_tpu", "pallas_gpu", "xla"]
# The JAX backends take CPU tensors on any machine (through DLPack; moved to a TPU/GPU if there is one).
CPU = torch.device("cpu")


def f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(19, 2 * 256), (2, 3, 2 * 65)])
def test_silu_and_mul_kiln_jax_matches_float64(backend, dtype, shape):
    # (19, 512): d = 256 is a lane multiple, so the TPU kernel reads both halves straight from x.
    key = jax.random.key(random.randrange(2**31))
    x = (jax.random.normal(key, shape, jnp.float32) * 2.0).astype(dtype)
    d = shape[-1] // 2
    g, u = f64(x)[..., :d], f64(x)[..., d:]
    ref = g / (1 + np.exp(-g)) * u
    got = kjax.silu_and_mul(x, implementation=backend)
    assert got.shape == (*shape[:-1], d) and got.dtype == x.dtype
    assert np.isfinite(f64(got)).all(), "non-finite output"
    assert np.linalg.norm(f64(got) - ref) / np.linalg.norm(ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_and_mul_jax_backends_match_the_specs_float64_reference(backend, dtype):
    shape = {"rows": 9, "d": 300}
    case = run_case(get_op("silu_and_mul"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_and_mul_kiln_jax_on_empty_input_gives_an_empty_half(backend):
    assert kjax.silu_and_mul(jnp.ones((0, 3, 8)), implementation=backend).shape == (0, 3, 4)
    assert kjax.silu_and_mul(jnp.ones((2, 0)), implementation=backend).shape == (2, 0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kjax.silu_and_mul(jnp.ones((2, 5))), "x has last dim 5, expected an even size"),
        (lambda: kjax.silu_and_mul(jnp.ones((2, 4), jnp.int32)), "silu_and_mul: x has dtype int32"),
    ],
)
def test_silu_and_mul_kiln_jax_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_silu_and_mul_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    lower_for_tpu(lambda a: silu_and_mul_pallas_tpu(a, interpret=False), jnp.ones((13, 512), jnp.bfloat16))
    # d = 300 is not a lane multiple: the halves are split and padded to 128 lanes.
    lower_for_tpu(lambda a: silu_and_mul_pallas_tpu(a, interpret=False), jnp.ones((5, 2 * 300), jnp.float32))
