"""fp8_block_linear's Triton kernel: both ways of quantizing x (in registers, and the group quantizer
first), split-K over the groups, tiles that span several block_n rows of weight scales or share one,
against the float64 reference; configs that cannot work are named errors."""

import pytest
import torch

from kiln.ops.gemm.fp8_block_linear import FP8_BLOCK_LINEAR
from kiln.ops.gemm.fp8_block_linear import triton as fp8_block_triton
from kiln.verify import assert_close

pytestmark = pytest.mark.skipif(not fp8_block_triton.triton_available(None), reason="no Triton")


def _case(M, N, K, block_n, block_k, dtype, device, bias=False, seed=0):
    shape = {"M": M, "N": N, "K": K, "block_n": block_n, "block_k": block_k, "bias": bias}
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = FP8_BLOCK_LINEAR.make_inputs(shape, dtype, device, generator)
    args = [inputs[name] for name in ("x", "w_fp8", "w_scale", "block_n", "block_k", "bias", "out_dtype")]
    double = [
        a.double() if isinstance(a, torch.Tensor) and a.dtype != torch.float8_e4m3fn else a for a in args
    ]
    return args, FP8_BLOCK_LINEAR.reference(*double[:6], torch.float64)


def _config(block_m, block_n, block_k, split_k, num_warps=4, num_stages=2):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 2, "SPLIT_K": split_k,
            "num_warps": num_warps, "num_stages": num_stages}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "M, N, K, block_n, block_k, tile_n, split_k",
    [
        (5, 150, 200, 128, 32, 64, 3),  # tile inside one scale row; K tail; a split of whole groups
        (5, 150, 200, 32, 64, 64, 2),  # one tile spans two scale rows (scales per column)
        (20, 70, 96, 16, 32, 32, 4),  # split-K past the last group (an empty split)
    ],
)
def test_in_register_and_prequantized_x_agree_with_float64_under_split_k(
    monkeypatch, device, dtype, M, N, K, block_n, block_k, tile_n, split_k
):
    args, ref = _case(M, N, K, block_n, block_k, dtype, device, bias=True)
    config = _config(16 if M <= 16 else 32, tile_n, block_k, split_k)
    outs = []
    for in_register_max_m in (M, M - 1):  # x quantized in registers, then by the group quantizer first
        monkeypatch.setattr(fp8_block_triton, "IN_REGISTER_MAX_M", in_register_max_m)
        outs.append(fp8_block_triton.fp8_block_linear_triton(*args, config=config))
        assert_close(outs[-1].double(), ref, FP8_BLOCK_LINEAR.tolerance[dtype])
    # the same float32 operations on the same values, in the same order
    assert torch.equal(outs[0], outs[1])


def test_group_quantizer_pads_whole_groups_with_zeros_and_transposes_scales(device):
    x = torch.randn(3, 40, device=device)
    x_q, x_scale = fp8_block_triton.quantize_groups(x, 32)
    assert x_q.shape == (3, 64) and x_scale.shape == (2, 3)
    assert not x_q[:, 40:].float().any()
    expected = x.abs().reshape(3, -1)[:, :32].amax(1) / 448
    torch.testing.assert_close(x_scale[0], expected)


def test_config_with_a_k_step_other_than_block_k_is_a_named_error(device):
    args, _ = _case(4, 64, 128, 128, 64, torch.float32, device)
    with pytest.raises(ValueError, match="BLOCK_K=128 must equal the weight's block_k 64"):
        fp8_block_triton.fp8_block_linear_triton(*args, config=_config(16, 64, 128, 1))


def test_heuristic_splits_k_at_decode_and_uses_large_tiles_for_prefill():
    cpu = torch.device("cpu")  # the interpreter's SM count (8)
    decode = fp8_block_triton.heuristic_config(1, 512, 4096, 128, cpu)
    assert decode["BLOCK_M"] == 16 and decode["SPLIT_K"] > 1
    prefill = fp8_block_triton.heuristic_config(4096, 4096, 4096, 128, cpu)
    assert prefill["BLOCK_M"] * prefill["BLOCK_N"] >= 128 * 128 and prefill["SPLIT_K"] == 1
    assert all(
        c["BLOCK_K"] == 128 for c in fp8_block_triton.fp8_block_configs({"M": 1, "N": 512, "K": 4096}, None)
    )
