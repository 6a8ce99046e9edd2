"""quantize_fp8's JAX backends (quantize_int8's row-wise Mosaic TPU and Pallas Triton kernels with e4m3
output, per token and per tensor, interpreted on the CPU; XLA) against float64, and the kernels' Mosaic /
Triton lowering."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.quantize_fp8.pallas_gpu import quantize_fp8_pallas_gpu  # noqa: E402
from kiln.ops.gemm.quantize_fp8.pallas_tpu import quantize_fp8_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize("per_token", [True, False])
def test_quantize_fp8_jax_backends_match_float64(backend, per_token):
    shape = {"M": 37, "K": 300, "per_token": per_token}
    case = run_case(get_op("quantize_fp8"), backend, shape, torch.float16, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_token", [True, False])
def test_quantize_fp8_pallas_gpu_several_rows_per_program_match_float64(dtype, per_token):
    # K 1100 pads to 2048: two rows per program, M 5 leaves a padded row in the last one
    shape = {"M": 5, "K": 1100, "per_token": per_token}
    case = run_case(get_op("quantize_fp8"), "pallas_gpu", shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_gpu", "xla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [True, False])
def test_quantize_fp8_jax_codes_and_scales_are_torchs_bit_for_bit(backend, dtype, per_token):
    """Both divisions rounded once (div_rn), as the CPU backend's torch divides: with XLA's reciprocal
    product some scales were an ulp off and some x / scale took the other e4m3 neighbour."""
    x = torch.randn((203, 300), generator=torch.Generator().manual_seed(random.randrange(2**31))).to(dtype)
    op = get_op("quantize_fp8")
    q, scale = op.implementation(backend).fn(x, per_token)
    q_cpu, scale_cpu = op.implementation("cpu").fn(x, per_token)
    assert torch.equal(scale, scale_cpu)
    assert torch.equal(q.float(), q_cpu.float())


@pytest.mark.parametrize("per_token", [True, False])
def test_quantize_fp8_gpu_kernel_lowers_to_triton(lower_for_gpu, per_token):
    x = jnp.ones((40, 700), jnp.bfloat16)
    text = lower_for_gpu(lambda a: quantize_fp8_pallas_gpu(a, per_token, interpret=False), x)
    assert "div.rn.f32" in text  # x / scale rounded once, as the Triton kernel divides


@pytest.mark.parametrize("per_token", [True, False])
def test_quantize_fp8_tpu_kernel_lowers_to_mosaic(lower_for_tpu, per_token):
    x = jnp.ones((40, 700), jnp.bfloat16)
    lower_for_tpu(lambda a: quantize_fp8_pallas_tpu(a, per_token, interpret=False), x)
