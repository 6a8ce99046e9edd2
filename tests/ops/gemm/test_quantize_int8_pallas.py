"""quantize_int8's JAX backends (the row-wise Mosaic TPU and Pallas Triton kernels interpreted on the
CPU, and XLA) against float64, ties rounded away from zero, and the kernels' Mosaic / Triton lowering."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.quantize_int8.pallas_gpu import quantize_int8_pallas_gpu  # noqa: E402
from kiln.ops.gemm.quantize_int8.pallas_tpu import quantize_int8_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize("shape", [{"M": 1, "K": 1}, {"M": 37, "K": 300}])
def test_quantize_int8_jax_backends_match_float64(backend, shape):
    case = run_case(get_op("quantize_int8"), backend, shape, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_int8_pallas_gpu_several_rows_per_program_match_float64(dtype):
    # K 1100 pads to 2048: two rows per program, M 5 leaves a padded row in the last one
    case = run_case(get_op("quantize_int8"), "pallas_gpu", {"M": 5, "K": 1100}, dtype, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("kernel", [quantize_int8_pallas_tpu, quantize_int8_pallas_gpu])
def test_quantize_int8_kernels_round_ties_away_from_zero(kernel):
    # amax 127 -> scale 1: x / scale is exactly +-0.5, +-1.5, +-2.5
    x = jnp.asarray([[127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.0]], jnp.float32)
    q, scale = kernel(x)
    assert float(scale[0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(q), [[127, 1, -1, 2, -2, 3, -3, 0]])


@pytest.mark.parametrize("backend", ["pallas_gpu", "xla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_int8_jax_codes_and_scales_are_torchs_bit_for_bit(backend, dtype):
    """Both divisions rounded once (div_rn), as the CPU backend's torch divides (XLA's reciprocal
    product put some scales an ulp off)."""
    x = torch.randn((203, 300), generator=torch.Generator().manual_seed(random.randrange(2**31))).to(dtype)
    op = get_op("quantize_int8")
    q, scale = op.implementation(backend).fn(x)
    q_cpu, scale_cpu = op.implementation("cpu").fn(x)
    assert torch.equal(scale, scale_cpu)
    assert torch.equal(q, q_cpu)


def test_quantize_int8_gpu_kernel_lowers_to_triton(lower_for_gpu):
    x = jnp.ones((40, 700), jnp.bfloat16)
    text = lower_for_gpu(lambda a: quantize_int8_pallas_gpu(a, interpret=False), x)
    assert "div.rn.f32" in text  # x / scale rounded once, as the Triton kernel divides


def test_quantize_int8_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    lower_for_tpu(lambda a: quantize_int8_pallas_tpu(a, interpret=False), jnp.ones((40, 700), jnp.bfloat16))
