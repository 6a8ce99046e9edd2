"""linear_silu_mul's JAX backends: linear's Pallas kernels with the fused SiLU-and-mul epilogue (gate
and up tiles in one program), and XLA, against float64."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.linear_silu_mul.pallas_tpu import linear_silu_mul_pallas_tpu  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
def test_linear_silu_mul_jax_backends_match_float64(backend):
    shape = {"M": 5, "N": 70, "K": 96}
    case = run_case(get_op("linear_silu_mul"), backend, shape, torch.float32, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_linear_silu_mul_pallas_several_column_blocks_and_k_steps(backend):
    # N = 300: two 256-wide TPU column blocks (up rows start at 300, not at a block edge) or three of
    # 128 on the GPU kernel; K = 700: two TPU K steps, eleven GPU ones.
    shape = {"M": 40, "N": 300, "K": 700}
    case = run_case(get_op("linear_silu_mul"), backend, shape, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


def test_kiln_jax_linear_silu_mul_under_jit_on_3d_input():
    x = jax.random.normal(jax.random.key(0), (2, 3, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (2 * 24, 64), jnp.float32) / 8
    out = jax.jit(lambda a, b: kjax.linear_silu_mul(a, b, implementation="pallas_tpu"))(x, w)
    xt, wt = torch.tensor(np.asarray(x)).double(), torch.tensor(np.asarray(w)).double()
    assert out.shape == (2, 3, 24)
    ref = torch.nn.functional.silu(xt @ wt[:24].T) * (xt @ wt[24:].T)
    assert_close(torch.tensor(np.asarray(out)), ref, 1e-5)


def test_linear_silu_mul_jax_entry_rejects_odd_gate_up_rows():
    with pytest.raises(ValueError, match="expected an even 2N"):
        kjax.linear_silu_mul(jnp.ones((2, 8)), jnp.ones((7, 8)))


def test_linear_silu_mul_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x, w = jnp.ones((40, 700), jnp.bfloat16), jnp.ones((2 * 300, 700), jnp.bfloat16)
    lower_for_tpu(lambda a, b: linear_silu_mul_pallas_tpu(a, b, interpret=False), x, w)
