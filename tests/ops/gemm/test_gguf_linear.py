import random

import numpy as np
import pytest
import torch

import kiln.ops

pytest.importorskip("gguf")  # the references decode with gguf.quants (OpSpec.requires)
from kiln.ops.gemm.gguf_linear import GGUF_LINEAR
from kiln.ops.gemm.gguf_linear.triton import gguf_linear_triton
from kiln.verify import assert_close, run_case
from tests.ops.gemm.gguf_codec_bugs import PLANTED_CASES, plant_gguf_codec_bug

QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        {"M": 1, "N": 45, "K": 160, "qtype": "Q4_0", "bias": True},  # GEMV
        {"M": 3, "N": 70, "K": 96, "qtype": "Q4_1"},  # GEMV, several rows
        {"M": 1, "N": 37, "K": 224, "qtype": "Q8_0"},
        {"M": 17, "N": 33, "K": 64, "qtype": "Q4_1", "bias": True},  # tiled GEMM
        {"M": 20, "N": 19, "K": 128, "qtype": "Q8_0"},
        # K-quant super-blocks (256 weights) and Q5_0: the per-weight-decode GEMV and the tiled GEMM
        {"M": 1, "N": 37, "K": 512, "qtype": "Q4_K", "bias": True},
        {"M": 3, "N": 29, "K": 256, "qtype": "Q5_K"},
        {"M": 1, "N": 23, "K": 768, "qtype": "Q6_K"},
        {"M": 17, "N": 21, "K": 512, "qtype": "Q4_K"},
        {"M": 9, "N": 19, "K": 256, "qtype": "Q6_K", "bias": True},
        {"M": 18, "N": 13, "K": 256, "qtype": "Q5_K"},
        {"M": 2, "N": 19, "K": 96, "qtype": "Q5_0", "bias": True},
        {"M": 9, "N": 19, "K": 160, "qtype": "Q5_0"},
    ],
)
def test_gguf_linear_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(GGUF_LINEAR, backend, shape, dtype, device, seed())
    assert case.passed, case


@pytest.mark.parametrize("M", [1, 9])  # GEMV and GEMM paths
def test_gguf_linear_split_k_on_embedded_model_weight(smollm2_gguf_tensors, M, device):
    gguf = pytest.importorskip("gguf")
    tensor = smollm2_gguf_tensors["blk.0.attn_k.weight"]  # [192, 576] Q4_1
    qweight = torch.from_numpy(np.array(tensor.data)).to(device)
    w = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).double().to(device)
    x = torch.randn(M, 576, device=device)
    config = {
        "BLOCK_M": 16,
        "BLOCK_N": 64,
        "BLOCK_K": 64,
        "GROUP_M": 8,
        "SPLIT_K": 4,
        "num_warps": 4,
        "num_stages": 2,
    }
    out = gguf_linear_triton(x, qweight, "Q4_1", config=config)
    assert_close(out, x.double() @ w.T, 1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (torch.randn(2, 40), torch.zeros(3, 20, dtype=torch.uint8), "Q4_1"),
            "K=40 must be a multiple of 32",
        ),
        (
            (torch.randn(2, 64), torch.zeros(3, 40, dtype=torch.uint8), "Q4_0"),
            "not whole 18-byte Q4_0 blocks",
        ),
        ((torch.randn(2, 64), torch.zeros(3, 34, dtype=torch.uint8), "Q8_0"), "expected K/32 \\* 34 = 68"),
        ((torch.randn(2, 64), torch.zeros(3, 68, dtype=torch.uint8), "Q5_1"), "qtype 'Q5_1' unsupported"),
        (
            (torch.randn(2, 288), torch.zeros(3, 144, dtype=torch.uint8), "Q4_K"),
            "K=288 must be a multiple of 256 \\(the GGUF Q4_K super-block size\\)",
        ),
        (
            (torch.randn(2, 256), torch.zeros(3, 220, dtype=torch.uint8), "Q6_K"),
            "not whole 210-byte Q6_K blocks",
        ),
        (
            (torch.randn(2, 512), torch.zeros(3, 176, dtype=torch.uint8), "Q5_K"),
            "expected K/256 \\* 176 = 352",
        ),
        ((torch.randn(2, 64), torch.zeros(3, 68, dtype=torch.int8), "Q8_0"), "qweight has dtype int8"),
    ],
)
def test_gguf_linear_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.gguf_linear(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QTYPES + K_QUANTS)
@pytest.mark.parametrize("M", [1, 300])
def test_gguf_linear_bfloat16_on_gpu(qtype, M):
    K = 768 if qtype in K_QUANTS else 576
    case = run_case(GGUF_LINEAR, "triton", {"M": M, "N": 1000, "K": K, "qtype": qtype}, torch.bfloat16,
                    torch.device("cuda"), seed())  # fmt: skip
    assert case.passed, case


@pytest.mark.parametrize("M", [1, 9])  # GEMV and GEMM paths
def test_gguf_linear_k_quant_split_k_matches_gguf_package(M, device):
    # split-K cuts K at BLOCK_K multiples that fall inside a 256-weight super-block: each part must
    # still decode its own sub-blocks. The reference weight is the gguf package's decode.
    gguf = pytest.importorskip("gguf")
    from kiln.quant.gguf_blocks import quantize_blocks

    blocks = quantize_blocks(torch.randn(40, 768), "Q4_K")  # 3 splits of 192 weights (64-weight steps)
    w = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_K)).double()
    x = torch.randn(M, 768)
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 4, "num_warps": 4,
              "num_stages": 2}  # fmt: skip
    out = gguf_linear_triton(x.to(device), blocks.to(device), "Q4_K", config=config)
    assert_close(out.cpu(), x.double() @ w.T, 1e-5)


def test_verifier_inputs_catch_a_swapped_k_quant_sub_block_scale():
    # A kernel giving sub-block 0 the scale of sub-block 1 (Q4_K's 6-bit scales are easy to misread)
    # must fail: the spec's inputs vary the sub-block scales within each super-block.
    import dataclasses

    from kiln.ops.registry import Implementation
    from kiln.quant.gguf_blocks import dequantize_blocks

    def swapped(x, qweight, qtype, bias=None):
        blocks = qweight.reshape(qweight.shape[0], -1, 144).clone()
        blocks[..., 4] = (blocks[..., 4] & 0xC0) | (blocks[..., 5] & 0x3F)  # sc[0] := sc[1]
        return x @ dequantize_blocks(blocks.reshape(qweight.shape), qtype, x.dtype).T

    spec = dataclasses.replace(GGUF_LINEAR, implementations={})
    spec.register(Implementation("planted", swapped))
    case = run_case(
        spec, "planted", {"M": 3, "N": 20, "K": 512, "qtype": "Q4_K"}, torch.float32, torch.device("cpu"), 7
    )
    assert not case.passed and case.error > 1e-3


def test_verifier_inputs_catch_a_swapped_nibble_order():
    # A kernel reading weight j + 16 from the low nibble (the classic GGUF mistake) must fail the spec's
    # comparison: the fuzz inputs are not symmetric enough to hide it.
    import dataclasses

    from kiln.ops.registry import Implementation
    from kiln.quant.gguf_blocks import dequantize_blocks

    def swapped(x, qweight, qtype, bias=None):
        blocks = qweight.reshape(qweight.shape[0], -1, 20).clone()
        qs = blocks[..., 4:]
        blocks[..., 4:] = (qs >> 4) | (qs << 4)
        return x @ dequantize_blocks(blocks.reshape(qweight.shape), qtype, x.dtype).T

    spec = dataclasses.replace(GGUF_LINEAR, implementations={})
    spec.register(Implementation("planted", swapped))
    case = run_case(
        spec, "planted", {"M": 3, "N": 20, "K": 64, "qtype": "Q4_1"}, torch.float32, torch.device("cpu"), 7
    )
    assert not case.passed and case.error > 0.1


@pytest.mark.parametrize("helper, qtype", PLANTED_CASES)
def test_verify_catches_a_bug_in_the_cpu_paths_gguf_codec(helper, qtype, monkeypatch):
    # The reference decodes W with the gguf package, not kiln.quant.gguf_blocks (the CPU path's
    # codec): a bug planted in that codec must fail the check instead of being reproduced by it.
    shape, cpu = {"M": 3, "N": 20, "K": 512, "qtype": qtype, "bias": True}, torch.device("cpu")
    assert run_case(GGUF_LINEAR, "cpu", shape, torch.float32, cpu, 5).passed
    plant_gguf_codec_bug(monkeypatch, helper)
    case = run_case(GGUF_LINEAR, "cpu", shape, torch.float32, cpu, 5)
    assert not case.passed and case.error > 1e-3, case
