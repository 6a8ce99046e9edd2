"""linear's JAX backends (Pallas TPU / GPU kernels interpreted on the CPU, XLA) against float64, and
kiln.jax.linear / its older name kiln.jax.matmul."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.linear.pallas_tpu import linear_pallas_tpu  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")
# M 40 x N 300 x K 700 with 256/512 blocks: two N blocks and two K steps through the VMEM accumulator.
MULTI_BLOCK = {"M": 40, "N": 300, "K": 700, "bias": True}


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [{"M": 1, "N": 37, "K": 200}, {"M": 17, "N": 33, "K": 77, "bias": True}])
def test_linear_pallas_tpu_odd_shapes_match_float64(dtype, shape):
    case = run_case(get_op("linear"), "pallas_tpu", shape, dtype, CPU, seed=seed())
    assert case.passed, case


def test_linear_pallas_tpu_accumulates_over_k_steps():
    case = run_case(get_op("linear"), "pallas_tpu", MULTI_BLOCK, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_gpu", "xla"])
def test_linear_gpu_and_xla_match_float64(backend):
    # pallas_gpu: 40 x 300 x 700 is several 64 x 128 output tiles and 11 K steps of 64.
    case = run_case(get_op("linear"), backend, MULTI_BLOCK, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


def test_linear_pallas_gpu_fp32_odd_shape():
    shape = {"M": 17, "N": 33, "K": 77, "bias": True}
    case = run_case(get_op("linear"), "pallas_gpu", shape, torch.float32, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu", "xla"])
def test_kiln_jax_linear_takes_3d_input_and_empty_k_under_jit(implementation):
    x = jax.random.normal(jax.random.key(0), (2, 3, 48), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (29, 48), jnp.float32)
    bias = jnp.arange(29, dtype=jnp.float32)
    out = jax.jit(lambda a, b, c: kjax.linear(a, b, c, implementation=implementation))(x, w, bias)
    ref = torch.tensor(np.asarray(x)).double() @ torch.tensor(np.asarray(w)).double().T
    assert out.shape == (2, 3, 29)
    assert_close(torch.tensor(np.asarray(out)), ref + torch.arange(29).double(), 1e-5)
    empty_k = kjax.linear(jnp.ones((4, 0)), jnp.ones((29, 0)), bias, implementation=implementation)
    assert (np.asarray(empty_k) == np.broadcast_to(np.arange(29), (4, 29))).all()


def test_kiln_jax_matmul_is_linear_under_its_older_name():
    x = jax.random.normal(jax.random.key(0), (5, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (40, 64), jnp.bfloat16)
    for implementation in ("pallas_tpu", "xla"):
        got = kjax.matmul(x, w, implementation=implementation)
        want = kjax.linear(x, w, implementation=implementation)
        assert (np.asarray(got, np.float32) == np.asarray(want, np.float32)).all()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kjax.matmul(jnp.ones((2, 8)), jnp.ones((4, 7))), "weight has last dim 7"),
        (lambda: kjax.linear(jnp.ones((2, 8)), jnp.ones((4, 8), jnp.bfloat16)), "must share one dtype"),
        (
            lambda: kjax.matmul(jnp.ones((2, 8)), jnp.ones((4, 8)), implementation="cuda"),
            "unknown implementation",
        ),
    ],
)
def test_linear_jax_entries_reject_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_linear_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x, w = jnp.ones((40, 700), jnp.bfloat16), jnp.ones((300, 700), jnp.bfloat16)
    lower_for_tpu(lambda a, b: linear_pallas_tpu(a, b, interpret=False), x, w)
