"""int4_linear's JAX backends (the Mosaic TPU kernel unpacking nibble planes in VMEM and the Pallas
Triton kernel unpacking words in registers, interpreted on the CPU, and XLA) against float64, and the
kernels' Mosaic / Triton lowering."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.int4_linear.pallas_gpu import int4_linear_pallas_gpu  # noqa: E402
from kiln.ops.gemm.int4_linear.pallas_tpu import int4_linear_pallas_tpu  # noqa: E402
from kiln.ops.gemm.int4_linear.spec import int4_linear_reference  # noqa: E402
from kiln.ops.jax_bridge import to_jax, to_torch  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [{"M": 1, "N": 37, "K": 77, "group_size": 32}, {"M": 17, "N": 33, "K": 200, "group_size": 128}]
)
def test_int4_linear_pallas_kernels_odd_shapes_match_float64(backend, dtype, shape):
    case = run_case(get_op("int4_linear"), backend, shape, dtype, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
def test_int4_linear_two_word_tiles_match_float64(backend):
    # K 1100 = 138 words: two 128-word steps through the accumulator, a short last group of 64
    # (pallas_gpu: 18 K steps of one 64-weight group each, three 128-column tiles)
    shape = {"M": 9, "N": 300, "K": 1100, "group_size": 64}
    case = run_case(get_op("int4_linear"), backend, shape, torch.float16, CPU, seed=seed())
    assert case.passed, case


def test_int4_linear_pallas_gpu_three_d_input_and_16x16_tiles():
    """x [2, 9, K]: 18 rows in two 16-row tiles; N 40 in three 16-column tiles; group 128 in K steps
    of 128 (K 300: the last group short, the last word half padding)."""
    generator = torch.Generator().manual_seed(seed())
    shape = {"M": 18, "N": 40, "K": 300, "group_size": 128}
    inputs = get_op("int4_linear").make_inputs(shape, torch.float32, CPU, generator)
    x = inputs["x"].reshape(2, 9, 300)
    args = [to_jax(inputs[name]) for name in ("qweight", "scales", "zeros")]
    out = int4_linear_pallas_gpu(to_jax(x), *args, 128, tiles=(16, 16))
    ref = int4_linear_reference(x.double(), inputs["qweight"], inputs["scales"], inputs["zeros"], 128)
    assert out.shape == (2, 9, 40)
    assert_close(to_torch(out).double(), ref, 1e-5)


def test_int4_gpu_kernel_lowers_to_triton(lower_for_gpu):
    x, qweight = jnp.ones((40, 700), jnp.bfloat16), jnp.ones((300, 88), jnp.int32)
    scales, zeros = jnp.ones((300, 22), jnp.bfloat16), jnp.ones((300, 22), jnp.uint8)
    lower_for_gpu(lambda *a: int4_linear_pallas_gpu(*a, 32, interpret=False), x, qweight, scales, zeros)


def test_int4_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x, qweight = jnp.ones((40, 700), jnp.bfloat16), jnp.ones((300, 88), jnp.int32)
    scales, zeros = jnp.ones((300, 11), jnp.bfloat16), jnp.ones((300, 11), jnp.uint8)
    lower_for_tpu(lambda *a: int4_linear_pallas_tpu(*a, 64, interpret=False), x, qweight, scales, zeros)
