"""fp8_block_linear's JAX backends against float64: the Mosaic TPU and Pallas Triton kernels (interpreted
on the CPU) over every block_k, odd M, partial weight blocks and several K steps, the XLA path, and the
kernels' Mosaic lowering for the sliced (block_k >= 128) and the masked (block_k < 128) group paths and
Triton lowering."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.fp8_block_linear.pallas_gpu import fp8_block_linear_pallas_gpu  # noqa: E402
from kiln.ops.gemm.fp8_block_linear.pallas_tpu import fp8_block_linear_pallas_tpu  # noqa: E402
from kiln.ops.gemm.fp8_block_linear.spec import block_scales, quantize_groups_reference  # noqa: E402
from kiln.ops.gemm.fp8_block_linear.xla import quantize_groups  # noqa: E402
from kiln.ops.jax_bridge import to_jax, to_torch  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ({"M": 1, "N": 150, "K": 200}, torch.float32),  # decode, partial 128x128 blocks
        ({"M": 33, "N": 130, "K": 1100, "bias": True}, torch.bfloat16),  # 3 K steps of 4 groups
        ({"M": 33, "N": 40, "K": 96, "block_n": 16, "block_k": 32}, torch.float16),  # masked groups
        ({"M": 5, "N": 70, "K": 64, "block_n": 32, "block_k": 16, "bias": True}, torch.bfloat16),
        ({"M": 5, "N": 200, "K": 192, "block_n": 48, "block_k": 64, "bias": True}, torch.float32),
        ({"M": 1, "N": 260, "K": 600, "block_n": 96, "block_k": 256, "bias": True}, torch.float16),
    ],
)
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_fp8_block_linear_pallas_kernels_match_float64(backend, shape, dtype):
    case = run_case(get_op("fp8_block_linear"), backend, shape, dtype, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize(
    "shape",
    [{"M": 5, "N": 130, "K": 257, "bias": True}, {"M": 33, "N": 40, "K": 96, "block_n": 16, "block_k": 32}],
)
def test_fp8_block_linear_xla_matches_float64(shape):
    case = run_case(get_op("fp8_block_linear"), "xla", shape, torch.bfloat16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_jax_group_quantizer_is_the_specs_bit_for_bit(dtype):
    """quantize_groups (XLA, the Mosaic wrapper and, interpreted, the Pallas Triton kernel) against the
    spec's torch quantizer, every code and scale equal: with XLA's reciprocal product in place of the
    division ~1/3 of the scales were an ulp off and some x / s rounded to the other e4m3 neighbour."""
    generator = torch.Generator().manual_seed(seed())
    x = torch.randn((257, 700), generator=generator).to(dtype)
    x_q, x_scale = quantize_groups(to_jax(x), 64)
    got = to_torch(x_q.astype(jnp.float32)).reshape(257, -1, 64) * to_torch(x_scale)[..., None]
    assert torch.equal(got.reshape(257, -1)[:, :700], quantize_groups_reference(x, 64))


@pytest.mark.parametrize(
    ("kernel", "tiles"),
    [
        # a 3 x 3 x 3 grid, 2 groups per step, every tile edge inside a weight block (block_n=48)
        (fp8_block_linear_pallas_tpu, (32, 128, 128)),
        # a 5 x 19 grid of output tiles, 5 K steps (one group each), tile edges inside weight blocks
        (fp8_block_linear_pallas_gpu, (16, 16)),
    ],
)
def test_small_tiles_cover_several_row_column_and_k_tiles(kernel, tiles):
    """Small tiles on M=70, N=300, K=300, block_n=48, block_k=64: the tile loop, the scales and the
    bias against a float64 GEMM of the activations as xla.py's quantize_groups (which both kernels
    call) quantizes them; that quantizer is the spec's bit for bit (the test above)."""
    generator = torch.Generator().manual_seed(seed())
    shape = {"M": 70, "N": 300, "K": 300, "block_n": 48, "block_k": 64, "bias": True}
    inputs = get_op("fp8_block_linear").make_inputs(shape, torch.float32, CPU, generator)
    out = kernel(
        to_jax(inputs["x"]),
        to_jax(inputs["w_fp8"]),
        to_jax(inputs["w_scale"]),
        48,
        64,
        to_jax(inputs["bias"]),
        jnp.float32,
        tiles=tiles,
    )
    x_q, x_scale = quantize_groups(to_jax(inputs["x"]), 64)  # [70, 320] e4m3, [70, 5]
    x_groups = to_torch(x_q.astype(jnp.float32)).double().reshape(70, 5, 64)
    x_deq = (x_groups * to_torch(x_scale).double()[..., None]).reshape(70, 320)[:, :300]
    w_deq = inputs["w_fp8"].double() * block_scales(inputs["w_scale"].double(), 300, 300, 48, 64)
    ref = x_deq @ w_deq.T + inputs["bias"].double()
    error = ((to_torch(out).double() - ref).norm() / ref.norm()).item()
    assert error < 1e-5, error


def test_tiles_off_the_tpu_tiling_raise():
    x, w = jnp.ones((4, 256)), jnp.ones((8, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="tiles"):
        fp8_block_linear_pallas_tpu(x, w, jnp.ones((1, 2)), 128, 128, tiles=(32, 128, 64))


@pytest.mark.parametrize("tiles", [(16, 24), (8, 16), (16,)])
def test_gpu_tiles_not_powers_of_two_from_16_raise(tiles):
    x, w = jnp.ones((4, 256)), jnp.ones((8, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="tiles"):
        fp8_block_linear_pallas_gpu(x, w, jnp.ones((1, 2)), 128, 128, tiles=tiles)


@pytest.mark.parametrize(("block_n", "block_k"), [(128, 256), (48, 16)])
def test_fp8_block_gpu_kernel_lowers_to_triton(lower_for_gpu, block_n, block_k):
    """...with the quantizer's divisions as PTX div.rn.f32 (Triton's own float32 division is approximate)."""
    m, n, k = 40, 300, 700
    x, w = jnp.ones((m, k), jnp.bfloat16), jnp.ones((n, k), jnp.float8_e4m3fn)
    w_scale = jnp.ones((-(-n // block_n), -(-k // block_k)), jnp.float32)
    text = lower_for_gpu(
        lambda *a: fp8_block_linear_pallas_gpu(*a, block_n, block_k, jnp.ones((n,)), interpret=False),
        x,
        w,
        w_scale,
    )
    assert "div.rn.f32" in text


@pytest.mark.parametrize(("block_n", "block_k"), [(128, 128), (16, 32)])
def test_fp8_block_tpu_kernel_lowers_to_mosaic(lower_for_tpu, block_n, block_k):
    m, n, k = 40, 300, 700
    x, w = jnp.ones((m, k), jnp.bfloat16), jnp.ones((n, k), jnp.float8_e4m3fn)
    w_scale = jnp.ones((-(-n // block_n), -(-k // block_k)), jnp.float32)
    lower_for_tpu(
        lambda *a: fp8_block_linear_pallas_tpu(*a, block_n, block_k, jnp.ones((n,)), interpret=False),
        x,
        w,
        w_scale,
    )
