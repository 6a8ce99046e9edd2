"""Pallas TPU matmul and W8A16 (int8 weights x float activations) against the float64 references."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.pallas import matmul_pallas_tpu, w8a16_pallas_tpu  # noqa: E402
from kiln.ops.gemm.w8a16 import quantize_weight_int8  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")
# M 40 x N 300 x K 700 with 256/512 blocks: two N blocks and two K steps through the VMEM accumulator.
MULTI_BLOCK = {"M": 40, "N": 300, "K": 700, "bias": True}


@pytest.mark.parametrize("op", ["linear", "w8a16_linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [{"M": 1, "N": 37, "K": 200}, {"M": 17, "N": 33, "K": 77, "bias": True}])
def test_gemm_pallas_tpu_odd_shapes_match_float64(op, dtype, shape):
    case = run_case(get_op(op), "pallas_tpu", shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("op, dtype", [("linear", torch.bfloat16), ("w8a16_linear", torch.float16)])
def test_gemm_pallas_tpu_accumulates_over_k_steps(op, dtype):
    case = run_case(get_op(op), "pallas_tpu", MULTI_BLOCK, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_gpu", "xla"])
@pytest.mark.parametrize("op", ["linear", "w8a16_linear"])
def test_gemm_gpu_and_xla_match_float64(op, backend):
    # pallas_gpu: 40 x 300 x 700 is several 64 x 128 output tiles and 11 K steps of 64.
    case = run_case(get_op(op), backend, MULTI_BLOCK, torch.bfloat16, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_linear_silu_mul_composes_gemm_and_activation(backend):
    shape = {"M": 5, "N": 70, "K": 96}
    case = run_case(
        get_op("linear_silu_mul"), backend, shape, torch.float32, CPU, seed=random.randrange(2**31)
    )
    assert case.passed, case


def test_linear_pallas_gpu_fp32_odd_shape():
    shape = {"M": 17, "N": 33, "K": 77, "bias": True}
    case = run_case(get_op("linear"), "pallas_gpu", shape, torch.float32, CPU, seed=random.randrange(2**31))
    assert case.passed, case


def test_kiln_jax_w8a16_matmul_under_jit_with_flat_scale():
    w, scale = quantize_weight_int8(torch.randn(130, 96))
    x = jax.random.normal(jax.random.key(0), (5, 96), jnp.bfloat16)
    fn = jax.jit(lambda a, b, s: kjax.w8a16_matmul(a, b, s, implementation="pallas_tpu"))
    got = fn(x, jnp.asarray(w.numpy()), jnp.asarray(scale.numpy()[:, 0]))
    ref = torch.tensor(np.asarray(x, np.float32)).double() @ (w.double() * scale.double()).T
    assert_close(torch.tensor(np.asarray(got, np.float32)), ref, 1.6e-2)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kjax.matmul(jnp.ones((2, 8)), jnp.ones((4, 7))), "weight has last dim 7"),
        (
            lambda: kjax.matmul(jnp.ones((2, 8)), jnp.ones((4, 8)), implementation="cuda"),
            "unknown implementation",
        ),
        (
            lambda: kjax.w8a16_matmul(
                jnp.ones((2, 8)), jnp.ones((4, 8), jnp.int8), jnp.ones((4,), jnp.bfloat16)
            ),
            "weight_scale has dtype bfloat16",
        ),
    ],
)
def test_gemm_ops_reject_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_gemm_tpu_kernels_lower_to_mosaic(lower_for_tpu):
    x, w = jnp.ones((40, 700), jnp.bfloat16), jnp.ones((300, 700), jnp.bfloat16)
    lower_for_tpu(lambda a, b: matmul_pallas_tpu(a, b, interpret=False), x, w)
    w8, scale = jnp.ones((300, 700), jnp.int8), jnp.ones((300,), jnp.float32)
    lower_for_tpu(lambda a, b, s: w8a16_pallas_tpu(a, b, s, interpret=False), x, w8, scale)
