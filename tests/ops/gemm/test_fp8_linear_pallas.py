"""fp8_linear's JAX backends (int8_linear's Mosaic TPU and Pallas Triton kernels with e4m3 tiles widened
in VMEM / registers, interpreted on the CPU, and XLA) against float64, and the kernels' Mosaic / Triton
lowering."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.fp8_linear.pallas_gpu import fp8_linear_pallas_gpu  # noqa: E402
from kiln.ops.gemm.fp8_linear.pallas_tpu import fp8_linear_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize(
    "shape",
    [
        {"M": 17, "N": 33, "K": 77, "bias": True, "per_token": True},
        {"M": 40, "N": 300, "K": 700, "per_token": False},
    ],
)
def test_fp8_linear_jax_backends_match_float64(backend, shape):
    case = run_case(get_op("fp8_linear"), backend, shape, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_linear_pallas_gpu_out_dtypes_match_float64(dtype):
    shape = {"M": 65, "N": 19, "K": 40, "bias": True, "per_token": True}  # two 64-row tiles
    case = run_case(get_op("fp8_linear"), "pallas_gpu", shape, dtype, CPU, seed=seed())
    assert case.passed, case


def test_fp8_gpu_kernel_lowers_to_triton(lower_for_gpu):
    x, w = jnp.ones((40, 700), jnp.float8_e4m3fn), jnp.ones((300, 700), jnp.float8_e4m3fn)
    bias = jnp.ones((300,), jnp.bfloat16)
    lower_for_gpu(
        lambda *a: fp8_linear_pallas_gpu(*a, interpret=False), x, jnp.ones((1,)), w, jnp.ones((300, 1)), bias
    )


def test_fp8_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x, w = jnp.ones((40, 700), jnp.float8_e4m3fn), jnp.ones((300, 700), jnp.float8_e4m3fn)
    lower_for_tpu(
        lambda *a: fp8_linear_pallas_tpu(*a, interpret=False), x, jnp.ones((1,)), w, jnp.ones((300, 1))
    )
