"""fused_moe's JAX backends (the grouped expert GEMMs as Mosaic TPU kernels with the tile -> expert map
as scalar prefetch, and as Pallas Triton kernels reading it by index, both interpreted on the CPU;
XLA's ragged_dot) against float64, out-of-range expert ids, and the kernels' Mosaic / Triton lowering."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.moe.fused_moe.pallas_gpu import fused_moe_pallas_gpu  # noqa: E402
from kiln.ops.moe.fused_moe.pallas_tpu import fused_moe_pallas_tpu  # noqa: E402
from kiln.ops.moe.fused_moe.spec import fused_moe_reference  # noqa: E402
from kiln.verify import assert_close, run_case  # noqa: E402

CPU = torch.device("cpu")
SKEWED = {"tokens": 9, "hidden": 40, "intermediate": 24, "experts": 3, "top_k": 2, "skew": 0.7}


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_jax_backends_match_float64(backend, fp8):
    case = run_case(get_op("fused_moe"), backend, {**SKEWED, "fp8": fp8}, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        # 64-row tiles, three output column blocks, three K steps; hidden and intermediate not
        # multiples of the blocks (the weights are loaded with masks, never padded)
        {"tokens": 70, "hidden": 130, "intermediate": 72, "experts": 3, "top_k": 2, "skew": 0.5},
        {"tokens": 7, "hidden": 33, "intermediate": 19, "experts": 6, "top_k": 1, "fp8": True},
        {"tokens": 1, "hidden": 16, "intermediate": 16, "experts": 8, "top_k": 8},  # every expert, one row
    ],
)
def test_fused_moe_pallas_gpu_matches_float64(shape, dtype):
    case = run_case(get_op("fused_moe"), "pallas_gpu", shape, dtype, CPU, seed=seed())
    assert case.passed, case


KERNELS = {
    "pallas_tpu": fused_moe_pallas_tpu,
    "pallas_gpu": fused_moe_pallas_gpu,
    "xla": get_op("fused_moe").jax_implementations["xla"],
}


@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_fused_moe_out_of_range_ids_add_nothing(backend):
    rng = np.random.default_rng(seed())
    x = rng.standard_normal((6, 40)).astype(np.float32)
    w_gu = (rng.standard_normal((3, 48, 40)) * 40**-0.5).astype(np.float32)
    w_d = (rng.standard_normal((3, 40, 24)) * 24**-0.5).astype(np.float32)
    ids = np.array([[0, 3], [1, 2], [-1, 2], [2, 0], [1, 1], [7, 0]], np.int32)
    weights = rng.uniform(0.1, 1.0, ids.shape).astype(np.float32)
    got = KERNELS[backend](*(jnp.asarray(a) for a in (x, w_gu, w_d, weights, ids)))
    keep = torch.tensor((ids >= 0) & (ids < 3))
    t = {k: torch.tensor(v).double() for k, v in {"x": x, "gu": w_gu, "d": w_d, "w": weights}.items()}
    ref = fused_moe_reference(t["x"], t["gu"], t["d"], t["w"] * keep, torch.tensor(np.where(keep, ids, 0)))
    assert_close(torch.tensor(np.asarray(got)), ref, 2e-5)


def test_fused_moe_tpu_kernels_lower_to_mosaic(lower_for_tpu):
    x, ids = jnp.ones((11, 40), jnp.bfloat16), jnp.zeros((11, 2), jnp.int32)
    w_gu, w_d = jnp.ones((4, 48, 40), jnp.float8_e4m3fn), jnp.ones((4, 40, 24), jnp.float8_e4m3fn)
    scale = jnp.ones((4,))
    lower_for_tpu(
        lambda *a: fused_moe_pallas_tpu(*a, interpret=False),
        x,
        w_gu,
        w_d,
        jnp.ones((11, 2)),
        ids,
        scale,
        scale,
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_fused_moe_gpu_kernels_lower_to_triton(lower_for_gpu, dtype):
    """float8 experts widened in registers, 64-row tiles; the lowering test covers bf16 without fp8."""
    x, ids = jnp.ones((70, 130), dtype), jnp.zeros((70, 2), jnp.int32)
    w_gu, w_d = jnp.ones((3, 144, 130), jnp.float8_e4m3fn), jnp.ones((3, 130, 72), jnp.float8_e4m3fn)
    scale = jnp.ones((3,))
    text = lower_for_gpu(
        lambda *a: fused_moe_pallas_gpu(*a, interpret=False),
        x,
        w_gu,
        w_d,
        jnp.ones((70, 2)),
        ids,
        scale,
        scale,
    )
    assert text.count("xla.gpu.triton") >= 2  # the gate/up and the down GEMM
