"""int4_linear's JAX backends (the Mosaic TPU kernel unpacking nibble planes in VMEM, interpreted on
the CPU, and XLA) against float64, and the kernel's Mosaic lowering."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.int4_linear.pallas_tpu import int4_linear_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [{"M": 1, "N": 37, "K": 77, "group_size": 32}, {"M": 17, "N": 33, "K": 200, "group_size": 128}]
)
def test_int4_linear_pallas_tpu_odd_shapes_match_float64(dtype, shape):
    case = run_case(get_op("int4_linear"), "pallas_tpu", shape, dtype, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_tpu", "xla"])
def test_int4_linear_two_word_tiles_match_float64(backend):
    # K 1100 = 138 words: two 128-word steps through the accumulator, a short last group of 64
    shape = {"M": 9, "N": 300, "K": 1100, "group_size": 64}
    case = run_case(get_op("int4_linear"), backend, shape, torch.float16, CPU, seed=seed())
    assert case.passed, case


def test_int4_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x, qweight = jnp.ones((40, 700), jnp.bfloat16), jnp.ones((300, 88), jnp.int32)
    scales, zeros = jnp.ones((300, 11), jnp.bfloat16), jnp.ones((300, 11), jnp.uint8)
    lower_for_tpu(lambda *a: int4_linear_pallas_tpu(*a, 64, interpret=False), x, qweight, scales, zeros)
