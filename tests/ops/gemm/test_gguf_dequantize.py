import random

import numpy as np
import pytest
import torch

import kiln.ops

pytest.importorskip("gguf")  # the references decode with gguf.quants (OpSpec.requires)
from kiln.ops.gemm.gguf_dequantize import GGUF_DEQUANTIZE
from kiln.ops.gemm.gguf_dequantize.triton import gguf_dequantize_triton
from kiln.verify import assert_close, run_case
from tests.ops.gemm.gguf_codec_bugs import PLANTED_CASES, plant_gguf_codec_bug

QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
# byte offsets of the fp16 fields in a K-quant super-block
K_QUANT_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_dequantize_matches_float64_reference(backend, dtype, qtype, device):
    case = run_case(GGUF_DEQUANTIZE, backend, {"N": 33, "K": 160, "qtype": qtype}, dtype, device, seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", K_QUANTS)
def test_gguf_dequantize_k_quants_match_float64_reference(backend, dtype, qtype, device):
    case = run_case(GGUF_DEQUANTIZE, backend, {"N": 9, "K": 512, "qtype": qtype}, dtype, device, seed())
    assert case.passed, case


def random_k_quant_blocks(qtype: str, rows: int, super_blocks: int, rng) -> np.ndarray:
    """Raw uint8 rows of random bytes (every bit pattern of quants and 6-bit / int8 scales) whose
    fp16 fields are overwritten with finite random values."""
    from kiln.quant.gguf_blocks import BLOCK_BYTES

    blocks = rng.integers(0, 256, (rows, super_blocks, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset in K_QUANT_HALVES[qtype]:
        halves = rng.standard_normal((rows, super_blocks)).astype(np.float16) * np.float16(0.01)
        blocks[..., offset : offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_gguf_dequantize_k_quants_of_random_bytes_are_bit_exact_with_the_gguf_package(qtype, device):
    # Random bytes, not Kiln's encoder: every scale / min / high-bit pattern a real file may hold.
    gguf = pytest.importorskip("gguf")
    blocks = random_k_quant_blocks(qtype, 7, 3, np.random.default_rng(seed()))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]))
    for backend, on in (("triton", device), ("cpu", torch.device("cpu"))):
        qweight = torch.from_numpy(blocks).to(on)
        got = GGUF_DEQUANTIZE.implementation(backend).fn(qweight, qtype, torch.float32)
        assert torch.equal(got.cpu(), expected), backend


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_kiln_k_quant_encoder_makes_blocks_the_gguf_package_decodes_close_to_the_input(qtype):
    # The gguf package has no K-quant encoder: Kiln's round-to-nearest one must produce valid blocks
    # (gguf decodes them to what Kiln decodes) whose values are near the input.
    gguf = pytest.importorskip("gguf")
    from kiln.quant.gguf_blocks import dequantize_blocks, quantize_blocks

    w = torch.randn(6, 512)
    w[:, 3] *= -12.0
    w[1, 256:] = 0.0  # an all-zero super-block
    blocks = quantize_blocks(w, qtype)
    decoded = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype]))
    assert torch.equal(decoded, dequantize_blocks(blocks, qtype))
    assert torch.equal(decoded[1, 256:], torch.zeros(256))
    bound = {"Q4_K": 0.15, "Q5_K": 0.08, "Q6_K": 0.04}[qtype]  # ~ 1 / levels of the outlier-stretched range
    assert_close(decoded, w, bound)


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
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_1)
    out = kiln.ops.gguf_dequantize(torch.from_numpy(blocks), "Q5_1", torch.float16)
    assert out.dtype == torch.float16 and out.shape == (4, 64)
    assert torch.equal(
        out, torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q5_1)).half()
    )
    assert_close(out, torch.from_numpy(w), 0.1)


@pytest.mark.parametrize("helper, qtype", PLANTED_CASES)
def test_verify_catches_a_bug_in_the_cpu_paths_gguf_codec(helper, qtype, monkeypatch):
    # The reference decodes with the gguf package, not kiln.quant.gguf_blocks (the CPU path's codec):
    # a bug planted in that codec must fail the check instead of being reproduced by the reference.
    shape, cpu = {"N": 9, "K": 512, "qtype": qtype}, torch.device("cpu")
    assert run_case(GGUF_DEQUANTIZE, "cpu", shape, torch.float32, cpu, 5).passed
    plant_gguf_codec_bug(monkeypatch, helper)
    case = run_case(GGUF_DEQUANTIZE, "cpu", shape, torch.float32, cpu, 5)
    assert not case.passed and case.error > 1e-3, case
