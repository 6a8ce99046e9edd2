"""int8_linear's JAX backends (the Mosaic TPU and Pallas Triton kernels with int32 accumulation,
interpreted on the CPU, and XLA) against float64, kiln.jax.int8_linear under jit, and the kernels'
Mosaic / Triton lowering."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.int8_linear.pallas_gpu import int8_linear_pallas_gpu  # noqa: E402
from kiln.ops.gemm.int8_linear.pallas_tpu import int8_linear_pallas_tpu  # noqa: E402
from kiln.ops.gemm.int8_linear.spec import int8_linear_reference  # noqa: E402
from kiln.ops.jax_bridge import to_jax, to_torch  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")
# 40 x 300 x 700 with 256/512 blocks: two N blocks and two K steps through the int32 accumulator.
MULTI_BLOCK = {"M": 40, "N": 300, "K": 700, "bias": True, "per_token": True}


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize(
    "shape",
    [
        {"M": 1, "N": 37, "K": 200, "per_token": False},
        {"M": 17, "N": 33, "K": 77, "bias": True, "per_token": True},
    ],
)
def test_int8_linear_pallas_kernels_odd_shapes_match_float64(backend, shape):
    case = run_case(get_op("int8_linear"), backend, shape, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_linear_pallas_gpu_out_dtypes_match_float64(dtype):
    shape = {"M": 5, "N": 70, "K": 96, "bias": True, "per_token": True}
    case = run_case(get_op("int8_linear"), "pallas_gpu", shape, dtype, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
def test_int8_linear_multi_block_matches_float64(backend):
    # pallas_gpu: three 128-column tiles, six K steps of 128 through the int32 accumulator
    case = run_case(get_op("int8_linear"), backend, MULTI_BLOCK, torch.float32, CPU, seed=seed())
    assert case.passed, case


def test_int8_linear_pallas_gpu_16x16_tiles_cover_a_3x4_grid():
    generator = torch.Generator().manual_seed(seed())
    shape = {"M": 40, "N": 50, "K": 300, "bias": True, "per_token": True}
    inputs = get_op("int8_linear").make_inputs(shape, torch.float32, CPU, generator)
    names = ("x_int8", "x_scale", "w_int8", "w_scale", "bias")
    out = int8_linear_pallas_gpu(*(to_jax(inputs[n]) for n in names), jnp.float32, tiles=(16, 16))
    ref = int8_linear_reference(*(inputs[n] if n.endswith("int8") else inputs[n].double() for n in names))
    assert_close(to_torch(out).double(), ref, 1e-5)


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu"])
def test_kiln_jax_int8_linear_under_jit(implementation):
    rng = np.random.default_rng(seed())
    x = rng.integers(-127, 128, (5, 96), dtype=np.int8)
    w = rng.integers(-127, 128, (130, 96), dtype=np.int8)
    xs, ws = (
        rng.uniform(0.01, 0.05, (5, 1)).astype(np.float32),
        rng.uniform(0.01, 0.05, (1,)).astype(np.float32),
    )
    fn = jax.jit(lambda *a: kjax.int8_linear(*a, out_dtype=jnp.float32, implementation=implementation))
    got = fn(jnp.asarray(x), jnp.asarray(xs), jnp.asarray(w), jnp.asarray(ws))
    ref = (torch.tensor(x).double() @ torch.tensor(w).double().T) * torch.tensor(xs).double() * float(ws[0])
    assert_close(torch.tensor(np.asarray(got)), ref, 1e-5)


def test_int8_gpu_kernel_lowers_to_triton(lower_for_gpu):
    x, w = jnp.ones((40, 700), jnp.int8), jnp.ones((300, 700), jnp.int8)
    xs, ws, bias = jnp.ones((40, 1)), jnp.ones((300, 1)), jnp.ones((300,), jnp.bfloat16)
    lower_for_gpu(lambda *a: int8_linear_pallas_gpu(*a, interpret=False), x, xs, w, ws, bias)


def test_int8_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x, w = jnp.ones((40, 700), jnp.int8), jnp.ones((300, 700), jnp.int8)
    xs, ws, bias = jnp.ones((40, 1)), jnp.ones((300, 1)), jnp.ones((300,), jnp.bfloat16)
    text = lower_for_tpu(lambda *a: int8_linear_pallas_tpu(*a, interpret=False), x, xs, w, ws, bias)
    assert "i32" in text
