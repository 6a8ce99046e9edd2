"""softmax's JAX backends (TPU interpreter, Pallas interpreter, XLA) against float64, through
kiln.jax.softmax and through the torch spec."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.softmax.softmax.pallas_tpu import softmax_pallas_tpu  # noqa: E402
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
def test_softmax_kiln_jax_matches_float64_on_3d_input(backend, dtype):
    key = jax.random.key(random.randrange(2**31))
    x = (jax.random.normal(key, (3, 5, 129), jnp.float32) * 3.0).astype(dtype)
    z = f64(x) / 2.0
    e = np.exp(z - z.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    got = kjax.softmax(x, 2.0, implementation=backend)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert np.isfinite(f64(got)).all(), "non-finite output"
    assert np.linalg.norm(f64(got) - ref) / np.linalg.norm(ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_jax_backends_match_the_specs_float64_reference_with_masked_logits(backend, dtype):
    shape = {"rows": 3, "cols": 777, "masked": True, "temperature": 0.7}  # -inf logits
    case = run_case(get_op("softmax"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


def test_softmax_kiln_jax_on_zero_rows_returns_the_empty_input():
    x = jnp.ones((0, 7), jnp.float32)
    assert kjax.softmax(x, implementation="pallas_tpu").shape == (0, 7)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kjax.softmax(jnp.ones((2, 3), jnp.int32)), "softmax: x has dtype int32"),
        (lambda: kjax.softmax(jnp.ones((2, 3)), temperature=0.0), "temperature must be a positive finite"),
        (lambda: kjax.softmax(jnp.ones((2, 0))), "last dim .* must be non-empty"),
        (lambda: kjax.softmax(jnp.ones((2, 3)), implementation="cuda"), "unknown implementation 'cuda'"),
    ],
)
def test_softmax_kiln_jax_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_softmax_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    lower_for_tpu(lambda a: softmax_pallas_tpu(a, interpret=False), jnp.ones((13, 512), jnp.bfloat16))
