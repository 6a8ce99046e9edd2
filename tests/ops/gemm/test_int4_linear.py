import dataclasses
import functools
import random

import pytest
import torch

import kiln.ops
from kiln.ops.gemm.int4_linear import INT4_LINEAR
from kiln.ops.gemm.int4_linear.triton import int4_linear_triton
from kiln.ops.registry import Implementation
from kiln.quant import quantize_int4, snr_db
from kiln.verify import assert_close, run_case


def seed() -> int:
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        {"M": 1, "N": 37, "K": 200, "group_size": 128},  # decode; K = 128 + 72: short last group
        {"M": 17, "N": 33, "K": 77, "group_size": 32},  # K not a multiple of 8 either
        {"M": 40, "N": 19, "K": 256, "group_size": 64},
    ],
)
def test_int4_linear_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(INT4_LINEAR, backend, shape, dtype, device, seed())
    assert case.passed, case


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_runs_what_quantize_int4_packs(group_size, device):
    # Packing contract between kiln.quant and the kernel: the GEMM of the quantized weight equals the
    # float64 GEMM of its dequantization, and stays close to the original float weight.
    x = torch.randn(3, 150, device=device)
    w = torch.randn(26, 150, device=device) / 12
    qweight, scales, zeros = quantize_int4(w, group_size)
    out = kiln.ops.int4_linear(x, qweight, scales, zeros, group_size)
    # BLOCK_K 64 spans two groups of 32 (per-element scale gather) or lies inside one group of 64 / 128.
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 4, "SPLIT_K": 2}
    config.update(num_warps=4, num_stages=2)
    out_split = int4_linear_triton(x, qweight, scales, zeros, group_size, config=config)
    dq = INT4_LINEAR.reference(x.double(), qweight, scales.double(), zeros, group_size)
    assert_close(out, dq, 1e-5)
    assert_close(out_split, dq, 1e-5)
    assert snr_db(x @ w.T, out) > 15.0  # 4-bit RTN with groups: ~20 dB on Gaussian weights


def test_int4_linear_unpacks_the_sign_nibble_and_the_first_nibble(device):
    # Word 0x80000001: nibble 0 = 1, nibble 7 = 8 (the sign bit of the int32), the rest 0.
    qweight = torch.tensor([[-(2**31) + 1]], dtype=torch.int32, device=device)
    scales = torch.ones(1, 1, device=device)
    zeros = torch.zeros(1, 1, dtype=torch.uint8, device=device)
    x = torch.zeros(16, 8, device=device)
    x[0, 0], x[1, 7] = 1.0, 1.0
    out = int4_linear_triton(x, qweight, scales, zeros, 32)
    assert out[:2, 0].tolist() == [1.0, 8.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"group_size": 48}, "group_size 48 unsupported"),
        ({"qweight": torch.zeros(4, 3, dtype=torch.int32)}, r"expected \[N, ceil\(K/8\)\] = \[4, 13\]"),
        (
            {"scales": torch.ones(4, 3)},
            r"scales has shape \(4, 3\), expected \[N, ceil\(K/group_size\)\] = \[4, 4\]",
        ),
        ({"zeros": torch.zeros(4, 4, dtype=torch.int32)}, "zeros has dtype int32"),
        ({"qweight": torch.zeros(4, 13, dtype=torch.int64)}, "qweight has dtype int64"),
    ],
)
def test_int4_linear_rejects_bad_input(kwargs, message):
    args = {
        "x": torch.randn(2, 100),
        "qweight": torch.zeros(4, 13, dtype=torch.int32),
        "scales": torch.ones(4, 4),
        "zeros": torch.zeros(4, 4, dtype=torch.uint8),
        "group_size": 32,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        kiln.ops.int4_linear(**args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [{"M": 1, "N": 4096, "K": 4096, "group_size": 128}, {"M": 300, "N": 577, "K": 1000, "group_size": 64}],
)
def test_int4_linear_bfloat16_on_gpu(shape):
    case = run_case(INT4_LINEAR, "triton", shape, torch.bfloat16, torch.device("cuda"), seed())
    assert case.passed, case


def test_verifier_inputs_catch_a_wrong_nibble_order_or_group_index():
    import dataclasses

    from kiln.ops.registry import Implementation
    from kiln.quant.int4 import dequantize_int4

    def reversed_nibbles(x, qweight, scales, zeros, group_size):
        words = torch.zeros_like(qweight)
        for i in range(8):  # nibble i moved to position 7 - i
            words |= ((qweight >> (4 * i)) & 0xF) << (4 * (7 - i))
        return x @ dequantize_int4(words, scales, zeros, group_size, x.shape[-1], x.dtype).T

    def group_off_by_one(x, qweight, scales, zeros, group_size):
        return (
            x
            @ dequantize_int4(
                qweight, scales.roll(1, 1), zeros.roll(1, 1), group_size, x.shape[-1], x.dtype
            ).T
        )

    shape = {"M": 3, "N": 20, "K": 100, "group_size": 32}
    for planted in (reversed_nibbles, group_off_by_one):
        spec = dataclasses.replace(INT4_LINEAR, implementations={})
        spec.register(Implementation("planted", planted))
        case = run_case(spec, "planted", shape, torch.float32, torch.device("cpu"), 11)
        assert not case.passed and case.error > 0.05, planted.__name__


def test_verify_catches_a_nibble_order_bug_in_the_cpu_paths_int4_decoder(monkeypatch):
    # The reference unpacks the nibbles itself, not through kiln.quant.int4 (the CPU path's decoder):
    # reversing the nibble order there must fail the check instead of being reproduced by the reference.
    import kiln.quant.int4 as int4

    shape, cpu = {"M": 3, "N": 20, "K": 100, "group_size": 32}, torch.device("cpu")
    assert run_case(INT4_LINEAR, "cpu", shape, torch.float32, cpu, 11).passed
    monkeypatch.setattr(int4, "NIBBLE_SHIFTS", int4.NIBBLE_SHIFTS.flip(0))
    case = run_case(INT4_LINEAR, "cpu", shape, torch.float32, cpu, 11)
    assert not case.passed and case.error > 0.05, case


@pytest.mark.parametrize(
    "block_k, group_size, split_k",
    [(32, 128, 1), (64, 32, 3), (128, 64, 2), (64, 64, 4)],  # one group per K tile, and several
)
def test_int4_linear_triton_tiles_across_groups_and_splits(block_k, group_size, split_k, device):
    """Pinned configs: a K tile inside one group and spanning several (scales broadcast per group),
    split-K whose last split ends mid-word (K = 203, not a multiple of 8)."""
    config = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "GROUP_M": 8, "SPLIT_K": split_k,
              "num_warps": 4, "num_stages": 2}  # fmt: skip
    spec = dataclasses.replace(INT4_LINEAR, implementations={})
    spec.register(Implementation("pinned", functools.partial(int4_linear_triton, config=config)))
    shape = {"M": 5, "N": 45, "K": 203, "group_size": group_size}
    case = run_case(spec, "pinned", shape, torch.float16, device, seed())
    assert case.passed, case
