"""w8a16_linear's JAX backends (linear's Pallas kernels with int8 weights and the per-channel scale
epilogue, and XLA) against float64, and kiln.jax.w8a16_linear / its older name w8a16_matmul."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.w8a16_linear import quantize_weight_int8  # noqa: E402
from kiln.ops.gemm.w8a16_linear.pallas_tpu import w8a16_linear_pallas_tpu  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")
# M 40 x N 300 x K 700 with 256/512 blocks: two N blocks and two K steps through the VMEM accumulator.
MULTI_BLOCK = {"M": 40, "N": 300, "K": 700, "bias": True}


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [{"M": 1, "N": 37, "K": 200}, {"M": 17, "N": 33, "K": 77, "bias": True}])
def test_w8a16_linear_pallas_tpu_odd_shapes_match_float64(dtype, shape):
    case = run_case(get_op("w8a16_linear"), "pallas_tpu", shape, dtype, CPU, seed=seed())
    assert case.passed, case


def test_w8a16_linear_pallas_tpu_accumulates_over_k_steps():
    case = run_case(get_op("w8a16_linear"), "pallas_tpu", MULTI_BLOCK, torch.float16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_gpu", "xla"])
def test_w8a16_linear_gpu_and_xla_match_float64(backend):
    # pallas_gpu: 40 x 300 x 700 is several 64 x 128 output tiles and 11 K steps of 64.
    case = run_case(get_op("w8a16_linear"), backend, MULTI_BLOCK, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


def test_kiln_jax_w8a16_matmul_under_jit_with_flat_scale():
    w, scale = quantize_weight_int8(torch.randn(130, 96))
    x = jax.random.normal(jax.random.key(0), (5, 96), jnp.bfloat16)
    fn = jax.jit(lambda a, b, s: kjax.w8a16_matmul(a, b, s, implementation="pallas_tpu"))
    got = fn(x, jnp.asarray(w.numpy()), jnp.asarray(scale.numpy()[:, 0]))
    ref = torch.tensor(np.asarray(x, np.float32)).double() @ (w.double() * scale.double()).T
    assert_close(torch.tensor(np.asarray(got, np.float32)), ref, 1.6e-2)


def test_w8a16_jax_entries_reject_a_bfloat16_scale():
    x, w, scale = jnp.ones((2, 8)), jnp.ones((4, 8), jnp.int8), jnp.ones((4,), jnp.bfloat16)
    for entry in (kjax.w8a16_matmul, kjax.w8a16_linear):
        with pytest.raises(ValueError, match="weight_scale has dtype bfloat16"):
            entry(x, w, scale)


def test_w8a16_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x = jnp.ones((40, 700), jnp.bfloat16)
    w8, scale = jnp.ones((300, 700), jnp.int8), jnp.ones((300,), jnp.float32)
    lower_for_tpu(lambda a, b, s: w8a16_linear_pallas_tpu(a, b, s, interpret=False), x, w8, scale)
