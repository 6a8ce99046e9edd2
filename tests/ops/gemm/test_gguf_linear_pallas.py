"""gguf_linear's JAX backends against float64: the Mosaic TPU kernel decoding the raw GGUF blocks in
VMEM (interpreted on the CPU) and the Pallas Triton kernel decoding them in registers (in the Pallas
interpreter) for every block format, odd M and N off the tiles, several M, N and K tiles through the
accumulator; the XLA path (the jax.numpy block decoder, then the GEMM); the Mosaic lowering for a
32-block and a K-quant format and the Triton lowering for every format."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.gguf_blocks import QTYPES  # noqa: E402
from kiln.ops.gemm.gguf_linear.pallas_gpu import gguf_linear_pallas_gpu  # noqa: E402
from kiln.ops.gemm.gguf_linear.pallas_tpu import gguf_linear_pallas_tpu  # noqa: E402
from kiln.ops.gemm.gguf_linear.spec import gguf_linear_reference  # noqa: E402
from kiln.ops.jax_bridge import to_jax, to_torch  # noqa: E402
from kiln.quant.gguf_blocks import row_bytes  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ({"M": 1, "N": 45, "K": 160, "qtype": "Q4_0", "bias": True}, torch.float32),  # 5 blocks: padded
        ({"M": 3, "N": 130, "K": 96, "qtype": "Q4_1"}, torch.bfloat16),  # two 128-row tiles
        ({"M": 17, "N": 37, "K": 64, "qtype": "Q5_0", "bias": True}, torch.float16),
        ({"M": 3, "N": 45, "K": 160, "qtype": "Q8_0"}, torch.float32),
        ({"M": 1, "N": 37, "K": 512, "qtype": "Q4_K", "bias": True}, torch.bfloat16),
        ({"M": 3, "N": 29, "K": 256, "qtype": "Q5_K"}, torch.float32),
        ({"M": 17, "N": 21, "K": 256, "qtype": "Q6_K", "bias": True}, torch.float16),
    ],
)
def test_gguf_linear_pallas_every_format_matches_float64(shape, dtype, backend):
    case = run_case(get_op("gguf_linear"), backend, shape, dtype, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize(
    ("shape", "tile_blocks"),
    [
        ({"M": 20, "N": 150, "K": 384, "qtype": "Q4_1", "bias": True}, 4),  # 3 K tiles of 128 weights
        ({"M": 20, "N": 150, "K": 512, "qtype": "Q5_K", "bias": True}, 1),  # 2 K tiles of one super-block
    ],
)
def test_several_row_column_and_k_tiles_accumulate(shape, tile_blocks):
    """block_m=16 and the K tile forced small: a 2 x 2 x (2|3) grid through the float32 accumulator."""
    inputs = get_op("gguf_linear").make_inputs(
        shape, torch.float32, CPU, torch.Generator().manual_seed(seed())
    )
    x, qweight, bias = inputs["x"], inputs["qweight"], inputs["bias"]
    out = gguf_linear_pallas_tpu(
        to_jax(x), to_jax(qweight), shape["qtype"], to_jax(bias), tile_blocks=tile_blocks, block_m=16
    )
    ref = gguf_linear_reference(x.double(), qweight, shape["qtype"], bias.double())
    error = ((to_torch(out).double() - ref).norm() / ref.norm()).item()
    assert error < 1e-5, error


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ({"M": 20, "N": 40, "K": 96, "qtype": "Q4_1", "bias": True}, torch.float32),  # 3 K steps of 32
        ({"M": 20, "N": 40, "K": 256, "qtype": "Q6_K", "bias": True}, torch.float16),  # 8 per super-block
    ],
)
def test_pallas_gpu_several_row_column_and_k_tiles_accumulate(shape, dtype):
    """blocks (16, 16, 32): a 2 x 3 grid (the last M and N blocks padded), K in 32-weight steps."""
    inputs = get_op("gguf_linear").make_inputs(shape, dtype, CPU, torch.Generator().manual_seed(seed()))
    x, qweight, bias = inputs["x"], inputs["qweight"], inputs["bias"]
    out = gguf_linear_pallas_gpu(
        to_jax(x), to_jax(qweight), shape["qtype"], to_jax(bias), blocks=(16, 16, 32)
    )
    ref = gguf_linear_reference(x.double(), qweight, shape["qtype"], bias.double())
    error = ((to_torch(out).double() - ref).norm() / ref.norm()).item()
    assert error < (1e-5 if dtype == torch.float32 else 2e-3), error


def test_pallas_gpu_blocks_off_the_triton_rules_raise():
    x, qweight = jnp.ones((2, 96)), jnp.zeros((4, row_bytes("Q4_0", 96)), jnp.uint8)
    with pytest.raises(ValueError, match="block_k dividing K=96"):
        gguf_linear_pallas_gpu(x, qweight, "Q4_0", blocks=(16, 16, 64))


def test_a_k_tile_off_the_decoded_tile_alignment_raises():
    x, qweight = jnp.ones((2, 96)), jnp.zeros((4, row_bytes("Q4_0", 96)), jnp.uint8)
    with pytest.raises(ValueError, match="tile_blocks"):
        gguf_linear_pallas_tpu(x, qweight, "Q4_0", tile_blocks=3)


@pytest.mark.parametrize(
    "shape",
    [
        {"M": 3, "N": 45, "K": 160, "qtype": "Q4_1", "bias": True},
        {"M": 1, "N": 37, "K": 512, "qtype": "Q4_K"},
        {"M": 9, "N": 19, "K": 256, "qtype": "Q5_0"},
    ],
)
def test_gguf_linear_xla_matches_float64(shape):
    case = run_case(get_op("gguf_linear"), "xla", shape, torch.float16, CPU, seed=seed())
    assert case.passed, case


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_gguf_tpu_kernel_lowers_to_mosaic(lower_for_tpu, qtype):
    m, n, k = 40, 300, 4096
    x = jnp.ones((m, k), jnp.bfloat16)
    qweight = jnp.zeros((n, row_bytes(qtype, k)), jnp.uint8)
    lower_for_tpu(lambda *a: gguf_linear_pallas_tpu(*a, qtype, jnp.ones((n,), jnp.bfloat16), interpret=False),
                  x, qweight)  # fmt: skip


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_gpu_kernel_lowers_to_triton(lower_for_gpu, qtype):
    # The shared lowering test reaches only Q4_0 and Q4_1 (the first fuzz shapes): every format here,
    # bf16 with a bias; float32 (IEEE dots) for one format.
    m, n, k = 40, 300, 4096
    dtype = jnp.float32 if qtype == "Q8_0" else jnp.bfloat16
    x, bias = jnp.ones((m, k), dtype), jnp.ones((n,), dtype)
    qweight = jnp.zeros((n, row_bytes(qtype, k)), jnp.uint8)
    lower_for_gpu(lambda *a: gguf_linear_pallas_gpu(*a, qtype, bias, interpret=False), x, qweight)
