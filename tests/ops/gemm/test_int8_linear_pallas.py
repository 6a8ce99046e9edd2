"""int8_linear's JAX backends (the Mosaic TPU kernel with int32 accumulation, interpreted on the CPU,
and XLA) against float64, kiln.jax.int8_linear under jit, and the kernel's Mosaic lowering."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.int8_linear.pallas_tpu import int8_linear_pallas_tpu  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")
# 40 x 300 x 700 with 256/512 blocks: two N blocks and two K steps through the int32 accumulator.
MULTI_BLOCK = {"M": 40, "N": 300, "K": 700, "bias": True, "per_token": True}


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize(
    "shape",
    [
        {"M": 1, "N": 37, "K": 200, "per_token": False},
        {"M": 17, "N": 33, "K": 77, "bias": True, "per_token": True},
    ],
)
def test_int8_linear_pallas_tpu_odd_shapes_match_float64(shape):
    case = run_case(get_op("int8_linear"), "pallas_tpu", shape, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_tpu", "xla"])
def test_int8_linear_multi_block_matches_float64(backend):
    case = run_case(get_op("int8_linear"), backend, MULTI_BLOCK, torch.float32, CPU, seed=seed())
    assert case.passed, case


def test_kiln_jax_int8_linear_under_jit():
    rng = np.random.default_rng(seed())
    x = rng.integers(-127, 128, (5, 96), dtype=np.int8)
    w = rng.integers(-127, 128, (130, 96), dtype=np.int8)
    xs, ws = (
        rng.uniform(0.01, 0.05, (5, 1)).astype(np.float32),
        rng.uniform(0.01, 0.05, (1,)).astype(np.float32),
    )
    fn = jax.jit(lambda *a: kjax.int8_linear(*a, out_dtype=jnp.float32, implementation="pallas_tpu"))
    got = fn(jnp.asarray(x), jnp.asarray(xs), jnp.asarray(w), jnp.asarray(ws))
    ref = (torch.tensor(x).double() @ torch.tensor(w).double().T) * torch.tensor(xs).double() * float(ws[0])
    assert_close(torch.tensor(np.asarray(got)), ref, 1e-5)


def test_int8_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x, w = jnp.ones((40, 700), jnp.int8), jnp.ones((300, 700), jnp.int8)
    xs, ws, bias = jnp.ones((40, 1)), jnp.ones((300, 1)), jnp.ones((300,), jnp.bfloat16)
    text = lower_for_tpu(lambda *a: int8_linear_pallas_tpu(*a, interpret=False), x, xs, w, ws, bias)
    assert "i32" in text
