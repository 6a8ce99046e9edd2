import random

import numpy as np
import pytest
import torch

import kiln.ops
from kiln.ops.gemm.gguf_dequantize import GGUF_DEQUANTIZE
from kiln.ops.gemm.gguf_dequantize.triton import gguf_dequantize_triton
from kiln.verify import assert_close, run_case

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_dequantize_matches_float64_reference(backend, dtype, qtype, device):
    case = run_case(GGUF_DEQUANTIZE, backend, {"N": 33, "K": 160, "qtype": qtype}, dtype, device, seed())
    assert case.passed, case


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_dequantize_is_bit_exact_with_the_gguf_package(qtype, device):
    gguf = pytest.importorskip("gguf")
    w = np.random.default_rng(seed()).standard_normal((9, 96)).astype(np.float32)
    w[:, 5] *= -20.0  # an outlier of either sign per block
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]))
    for backend, on in (("triton", device), ("cpu", torch.device("cpu"))):
        qweight = torch.from_numpy(blocks).to(on)
        got = GGUF_DEQUANTIZE.implementation(backend).fn(qweight, qtype, torch.float32)
        assert torch.equal(got.cpu(), expected), backend


def test_embedded_model_q4_1_tensor_dequantizes_bit_exactly(smollm2_gguf_tensors, device):
    gguf = pytest.importorskip("gguf")
    tensor = smollm2_gguf_tensors["blk.0.attn_k.weight"]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    qweight = torch.from_numpy(np.array(tensor.data))
    assert torch.equal(gguf_dequantize_triton(qweight.to(device), "Q4_1").cpu(), expected)
    assert torch.equal(kiln.ops.gguf_dequantize(qweight, "Q4_1"), expected)  # CPU path


def test_embedded_model_q8_0_token_embd_dequantizes_bit_exactly(smollm2_gguf_tensors, device):
    gguf = pytest.importorskip("gguf")
    tensor = smollm2_gguf_tensors["token_embd.weight"]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    qweight = torch.from_numpy(np.array(tensor.data))  # [49152, 612]
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(kiln.ops.gguf_dequantize(qweight, "Q8_0"), expected)  # CPU path, whole table
    rows = torch.cat([torch.arange(0, 64), torch.arange(49152 - 64, 49152)])  # the interpreter is slow
    assert torch.equal(gguf_dequantize_triton(qweight[rows].to(device), "Q8_0").cpu(), expected[rows])


def test_gguf_dequantize_falls_back_to_the_gguf_package_for_other_types():
    gguf = pytest.importorskip("gguf")
    w = np.random.default_rng(seed()).standard_normal((4, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    out = kiln.ops.gguf_dequantize(torch.from_numpy(blocks), "Q5_0", torch.float16)
    assert out.dtype == torch.float16 and out.shape == (4, 64)
    assert torch.equal(
        out, torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q5_0)).half()
    )
    assert_close(out, torch.from_numpy(w), 0.1)
