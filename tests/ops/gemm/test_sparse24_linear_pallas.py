"""sparse24_linear's JAX backends (the Mosaic TPU kernel expanding the 2:4 weight in VMEM, interpreted
on the CPU; the Pallas Triton kernel expanding it in registers, in the Pallas interpreter; and XLA)
against float64, kiln.jax.sparse24_linear under jit, and the kernels' Mosaic and Triton lowerings."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.sparse24_linear.pallas_gpu import sparse24_linear_pallas_gpu  # noqa: E402
from kiln.ops.gemm.sparse24_linear.pallas_tpu import sparse24_linear_pallas_tpu  # noqa: E402
from kiln.ops.jax_bridge import to_jax, to_torch  # noqa: E402
from kiln.quant.sparse24 import compress_24, decompress_24, prune_24  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")
# K 1100: 550 values columns, two 512-column steps through the accumulator (the second mostly padding);
# N 300: two 256-row blocks.
MULTI_BLOCK = {"M": 17, "N": 300, "K": 1100}


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"M": 1, "N": 37, "K": 4},  # one group: an odd meta byte count, its high nibble unused
        {"M": 3, "N": 130, "K": 204, "bias": True},
        {"M": 17, "N": 33, "K": 76},
    ],
)
def test_sparse24_linear_pallas_odd_shapes_match_float64(dtype, shape, backend):
    case = run_case(get_op("sparse24_linear"), backend, shape, dtype, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("bias", [False, True])
def test_sparse24_linear_pallas_tpu_two_k_steps_and_n_blocks_match_float64(bias):
    shape = {**MULTI_BLOCK, "bias": bias}
    case = run_case(get_op("sparse24_linear"), "pallas_tpu", shape, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("bias", [False, True])
def test_sparse24_linear_pallas_gpu_several_k_steps_and_n_blocks_match_float64(bias):
    # K 100 in 16-column steps (7 steps, the last one 12 columns past K); N 40 in 3 blocks of 16.
    shape = {"M": 17, "N": 40, "K": 100, "bias": bias}
    inputs = get_op("sparse24_linear").make_inputs(
        shape, torch.float16, CPU, torch.Generator().manual_seed(seed())
    )
    x, values, meta, b = (inputs[n] for n in ("x", "values", "meta", "bias"))
    got = sparse24_linear_pallas_gpu(
        to_jax(x), to_jax(values), to_jax(meta), None if b is None else to_jax(b), blocks=(16, 16, 16)
    )
    ref = get_op("sparse24_linear").reference(
        x.double(), values.double(), meta, None if b is None else b.double()
    )
    assert_close(to_torch(got), ref, 2e-3)


@pytest.mark.parametrize("shape", [{"M": 1, "N": 37, "K": 4}, {"M": 17, "N": 33, "K": 204, "bias": True}])
def test_sparse24_linear_xla_matches_float64(shape):
    case = run_case(get_op("sparse24_linear"), "xla", shape, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
def test_kiln_jax_sparse24_linear_pallas_under_jit_with_leading_dims(implementation):
    generator = torch.Generator().manual_seed(seed())
    weight = prune_24(torch.randn(40, 20, generator=generator, dtype=torch.float64))
    values, meta = compress_24(weight)
    x = torch.randn(2, 3, 20, generator=generator, dtype=torch.float64)
    bias = torch.randn(40, generator=generator, dtype=torch.float64)
    fn = jax.jit(lambda *a: kjax.sparse24_linear(*a, implementation=implementation))
    args = [jnp.asarray(t.float().numpy()) for t in (x, values)] + [jnp.asarray(meta.numpy())]
    got = fn(*args, jnp.asarray(bias.float().numpy()))
    assert got.shape == (2, 3, 40) and got.dtype == jnp.float32
    ref = x @ decompress_24(values, meta).T + bias
    assert_close(torch.tensor(np.asarray(got)), ref, 1e-5)


def test_sparse24_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    x, values = jnp.ones((40, 1100), jnp.bfloat16), jnp.ones((300, 550), jnp.bfloat16)
    meta, bias = jnp.ones((300, 138), jnp.uint8), jnp.ones((300,), jnp.bfloat16)
    lower_for_tpu(lambda *a: sparse24_linear_pallas_tpu(*a, interpret=False), x, values, meta, bias)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_sparse24_gpu_kernel_lowers_to_triton(lower_for_gpu, dtype):
    # The shared lowering test covers bf16; float32 (IEEE dots) and float16 here, with a bias.
    x, values = jnp.ones((40, 1100), dtype), jnp.ones((300, 550), dtype)
    meta, bias = jnp.ones((300, 138), jnp.uint8), jnp.ones((300,), dtype)
    lower_for_gpu(lambda *a: sparse24_linear_pallas_gpu(*a, interpret=False), x, values, meta, bias)
