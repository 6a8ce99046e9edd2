"""fp8_block_linear: block-scaled FP8 (128x128 weight blocks, x quantized per token and group of
block_k) against the float64 reference, on every backend, with partial blocks in N and K."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops.gemm.fp8_block_linear import FP8_BLOCK_LINEAR
from kiln.verify import assert_close, run_case


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_block_linear_fuzz_shapes_match_float64(backend, dtype, device):
    for shape in FP8_BLOCK_LINEAR.fuzz_shapes(random.Random(seed())):
        case = run_case(FP8_BLOCK_LINEAR, backend, shape, dtype, device, seed())
        assert case.passed, case


def test_fp8_block_linear_is_near_the_unquantized_product_and_rejects_wrong_scales(device):
    """The whole pipeline (weights quantized per 128x128 block, x per token-group) stays within the
    e4m3 budget of the float product; a w_scale of the wrong block grid is a named ValueError."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=generator).to(device)
    w = (torch.randn(130, 256, generator=generator) / 16).to(device)
    blocks = torch.nn.functional.pad(w, (0, 0, 0, 126)).reshape(2, 128, 2, 128)
    w_scale = blocks.abs().amax((1, 3)) / 448
    w_fp8 = (w / w_scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    out = kiln.ops.fp8_block_linear(x, w_fp8, w_scale, 128, 128, None, torch.float32)
    assert_close(out, x @ w.T, 0.08)  # two e4m3 roundings (2^-4 relative each, random in sign)
    with pytest.raises(ValueError, match="w_scale"):
        kiln.ops.fp8_block_linear(x, w_fp8, w_scale[:1], 128, 128, None, torch.float32)


def test_verify_catches_a_group_scale_bug_in_the_cpu_paths_activation_quantizer(monkeypatch):
    # The CPU path has its own activation quantizer, not the spec's reference one: one that ignores
    # block_k (a scale per token instead of per group) must fail the check.
    from kiln.ops.gemm.fp8_block_linear import cpu as fp8_block_cpu

    real = fp8_block_cpu.quantize_dequantize_groups
    shape = {"M": 33, "N": 40, "K": 96, "block_n": 16, "block_k": 32}
    cpu = torch.device("cpu")
    assert run_case(FP8_BLOCK_LINEAR, "cpu", shape, torch.float32, cpu, 11).passed
    monkeypatch.setattr(fp8_block_cpu, "quantize_dequantize_groups", lambda x, block_k: real(x, x.shape[1]))
    case = run_case(FP8_BLOCK_LINEAR, "cpu", shape, torch.float32, cpu, 11)
    assert not case.passed and case.error > 1e-3, case
