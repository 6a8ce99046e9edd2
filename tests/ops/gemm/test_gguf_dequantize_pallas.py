"""gguf_dequantize's XLA backend: every block format decoded in jax.numpy, float32 bit-exact with the
gguf package's decoder, and other GGML types through the host fallback."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
gguf = pytest.importorskip("gguf")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.gemm.gguf_blocks import QTYPES, make_gguf_weight  # noqa: E402
from kiln.ops.gemm.gguf_dequantize.xla import gguf_dequantize_xla  # noqa: E402
from kiln.quant.gguf_blocks import K_QUANTS  # noqa: E402
from kiln.verify import run_case  # noqa: E402


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_dequantize_xla_is_bit_exact_with_gguf(qtype):
    shape = {"N": 5, "K": 512 if qtype in K_QUANTS else 96, "qtype": qtype}
    qweight = make_gguf_weight(shape, "cpu", torch.Generator().manual_seed(random.randrange(2**31)))
    got = np.asarray(gguf_dequantize_xla(jnp.asarray(qweight.numpy()), qtype))
    expected = gguf.quants.dequantize(qweight.numpy(), gguf.GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(got, expected)


def test_gguf_dequantize_xla_rounds_to_the_asked_dtype():
    case = run_case(get_op("gguf_dequantize"), "xla", {"N": 9, "K": 512, "qtype": "Q6_K"}, torch.bfloat16,
                    torch.device("cpu"), seed=random.randrange(2**31))  # fmt: skip
    assert case.passed, case


def test_gguf_dequantize_xla_other_types_decode_on_the_host():
    values = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_1)
    got = gguf_dequantize_xla(jnp.asarray(data), "Q5_1")
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q5_1)
    np.testing.assert_array_equal(np.asarray(got), expected)
