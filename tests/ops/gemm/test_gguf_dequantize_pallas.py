"""gguf_dequantize's JAX backends: the Mosaic TPU kernel (raw GGUF blocks decoded in VMEM, interpreted on
the CPU), the Pallas Triton kernel (the blocks gathered and decoded in registers, in the Pallas
interpreter) and the XLA path (the jax.numpy decoder), every block format float32 bit-exact with the
gguf package's decoder; several row and K tiles, the fp16 scale decode over every bit pattern, other
GGML types through the host fallback, and the kernels' Mosaic and Triton lowerings."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
gguf = pytest.importorskip("gguf")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.gguf_blocks import QTYPES, make_gguf_weight  # noqa: E402
from kiln.ops.gemm.gguf_dequantize.pallas_gpu import gguf_dequantize_pallas_gpu  # noqa: E402
from kiln.ops.gemm.gguf_dequantize.pallas_tpu import gguf_dequantize_pallas_tpu  # noqa: E402
from kiln.ops.gemm.gguf_dequantize.xla import gguf_dequantize_xla  # noqa: E402
from kiln.ops.gemm.gguf_tpu import half_to_float32  # noqa: E402
from kiln.quant.gguf_blocks import K_QUANTS, row_bytes  # noqa: E402
from kiln.verify import run_case  # noqa: E402

BACKENDS = {
    "pallas_gpu": gguf_dequantize_pallas_gpu,
    "pallas_tpu": gguf_dequantize_pallas_tpu,
    "xla": gguf_dequantize_xla,
}


def _weight(shape) -> torch.Tensor:
    return make_gguf_weight(shape, "cpu", torch.Generator().manual_seed(random.randrange(2**31)))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_dequantize_is_bit_exact_with_gguf(qtype, backend):
    # K 96: 3 blocks, a tile padded with a zero block (pallas_tpu); K-quants: 2 super-blocks
    shape = {"N": 5, "K": 512 if qtype in K_QUANTS else 96, "qtype": qtype}
    qweight = _weight(shape)
    got = np.asarray(BACKENDS[backend](jnp.asarray(qweight.numpy()), qtype))
    expected = gguf.quants.dequantize(qweight.numpy(), gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("shape", "tile_blocks"),
    [
        ({"N": 130, "K": 384, "qtype": "Q8_0"}, 4),  # 2 row tiles x 3 K tiles of 136 bytes padded to 256
        ({"N": 7, "K": 512, "qtype": "Q6_K"}, 1),  # 2 K tiles of one super-block, 210 bytes padded to 256
    ],
)
def test_pallas_tpu_several_row_and_k_tiles_are_bit_exact_with_xla(shape, tile_blocks):
    qtype = shape["qtype"]
    qweight = jnp.asarray(_weight(shape).numpy())
    got = gguf_dequantize_pallas_tpu(qweight, qtype, tile_blocks=tile_blocks)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gguf_dequantize_xla(qweight, qtype)))


@pytest.mark.parametrize(
    "shape",
    [
        {"N": 70, "K": 512, "qtype": "Q8_0"},  # 3 row programs (the last masked) x 4 K tiles of 128
        {"N": 33, "K": 512, "qtype": "Q5_K"},  # 2 row programs (the second masked) x 4 half super-blocks
    ],
)
def test_pallas_gpu_several_row_and_k_tiles_are_bit_exact_with_xla(shape):
    qtype = shape["qtype"]
    qweight = jnp.asarray(_weight(shape).numpy())
    got = gguf_dequantize_pallas_gpu(qweight, qtype)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gguf_dequantize_xla(qweight, qtype)))


@pytest.mark.parametrize(
    ("qtype", "dtype"), [("Q4_1", torch.float16), ("Q4_K", torch.bfloat16), ("Q5_0", torch.float32)]
)
def test_gguf_dequantize_pallas_gpu_matches_float64(qtype, dtype):
    shape = {"N": 9, "K": 512, "qtype": qtype}
    case = run_case(get_op("gguf_dequantize"), "pallas_gpu", shape, dtype, torch.device("cpu"),
                    seed=random.randrange(2**31))  # fmt: skip
    assert case.passed, case


def test_fp16_scales_decode_exactly_for_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.int32)
    got = np.asarray(half_to_float32(jnp.asarray(bits)))
    expected = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_gguf_dequantize_rounds_to_the_asked_dtype(backend):
    case = run_case(get_op("gguf_dequantize"), backend, {"N": 9, "K": 512, "qtype": "Q6_K"}, torch.bfloat16,
                    torch.device("cpu"), seed=random.randrange(2**31))  # fmt: skip
    assert case.passed, case


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_gguf_dequantize_other_types_decode_on_the_host(backend):
    values = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_1)
    got = BACKENDS[backend](jnp.asarray(data), "Q5_1")
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q5_1)
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_K"])
def test_gguf_dequantize_tpu_kernel_lowers_to_mosaic(lower_for_tpu, qtype):
    qweight = jnp.zeros((300, row_bytes(qtype, 4096)), jnp.uint8)
    lower_for_tpu(lambda w: gguf_dequantize_pallas_tpu(w, qtype, jnp.bfloat16, interpret=False), qweight)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_dequantize_gpu_kernel_lowers_to_triton(lower_for_gpu, qtype):
    # The shared lowering test reaches only Q4_0 (the first fuzz shapes): every format here.
    qweight = jnp.zeros((300, row_bytes(qtype, 4096)), jnp.uint8)
    lower_for_gpu(lambda w: gguf_dequantize_pallas_gpu(w, qtype, jnp.bfloat16, interpret=False), qweight)
