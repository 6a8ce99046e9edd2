import dataclasses
import random

import pytest
import torch

import kiln.ops
import kiln.ops.tuned_configs
import kiln.tune
from kiln.ops.gemm.linear import LINEAR
from kiln.ops.gemm.linear.triton import linear_triton
from kiln.ops.registry import Implementation
from kiln.verify import assert_close, run_case

SHAPES = [
    {"M": 1, "N": 37, "K": 200, "bias": True},  # decode: split-K path
    {"M": 17, "N": 33, "K": 77},  # every dim odd: all masks
    {"M": 70, "N": 45, "K": 40, "bias": True},  # several M tiles: grouped order
]


def seed() -> int:
    return random.randrange(2**31)


def config(block_m, block_n, block_k, split_k, group_m=2):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m,
            "SPLIT_K": split_k, "num_warps": 4, "num_stages": 2}  # fmt: skip


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(LINEAR, backend, shape, dtype, device, seed())
    assert case.passed, case


def _linear_adding_split_k_partials_in_half(x, weight, bias=None):
    """A planted bug: each 64-wide K chunk's product rounded to x's dtype and the chunks summed in it."""
    out = torch.zeros(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    for k0 in range(0, x.shape[-1], 64):
        out += (x[..., k0 : k0 + 64].float() @ weight[:, k0 : k0 + 64].float().T).to(x.dtype)
    return out if bias is None else out + bias


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fuzz_shapes_catch_a_linear_that_adds_split_k_partials_in_half(dtype):
    # Below K ~ 2000 the partials' roundings stay under GEMM_TOLERANCE; the fuzz shapes' long-K case
    # (K = 8192) must fail such a kernel for any seed.
    spec = dataclasses.replace(LINEAR, implementations={})
    spec.register(Implementation("planted", _linear_adding_split_k_partials_in_half))
    shapes = LINEAR.fuzz_shapes(random.Random(seed()))
    cases = [run_case(spec, "planted", shape, dtype, torch.device("cpu"), seed()) for shape in shapes]
    assert any(not case.passed for case in cases), cases


@pytest.mark.parametrize("split_k", [1, 3])
def test_linear_explicit_configs_grouped_tiles_and_uneven_split_k(split_k, device):
    # 3 x 4 output tiles walked in groups of 2 rows; K = 100 over 3 splits of 2 x 16 (the last is short).
    x = torch.randn(40, 100, device=device)
    w = torch.randn(50, 100, device=device) / 10
    bias = torch.randn(50, device=device)
    out = linear_triton(x, w, bias, config=config(16, 16, 16, split_k))
    assert_close(out, x.double() @ w.double().T + bias.double(), 1e-5)


def test_linear_takes_3d_input_and_transposed_weight(device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")
    x = torch.randn(2, 3, 48, device=device)
    w = torch.randn(48, 29, device=device).T  # [29, 48] view with unit stride along N, not K
    out = kiln.ops.linear(x, w)
    assert out.shape == (2, 3, 29)
    assert_close(out, x.double() @ w.double().T, 1e-5)


def test_linear_reads_the_tuning_cache(tmp_path, monkeypatch, device):
    # A tuned entry for this op/shape bucket must be used: an incomplete one is reported, not ignored.
    monkeypatch.setenv("KILN_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(kiln.ops.tuned_configs, "_user_entries", None)
    shape = {"M": 4, "N": 8, "K": 16, "bias": False}
    kiln.tune.store("linear", torch.float32, shape, {"BLOCK_M": 16}, device=device)
    with pytest.raises(ValueError, match="missing BLOCK_N"):
        linear_triton(torch.randn(4, 16, device=device), torch.randn(8, 16, device=device))
    kiln.tune.store("linear", torch.float32, shape, config(16, 16, 16, 2), device=device)
    x, w = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    assert_close(linear_triton(x, w), x.double() @ w.double().T, 1e-5)
    monkeypatch.setattr(kiln.ops.tuned_configs, "_user_entries", None)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: (torch.randn(2, 8), torch.randn(4, 7), None),
            "weight has last dim 7, expected x's in-features 8",
        ),
        (lambda: (torch.randn(2, 8), torch.randn(4, 8).half(), None), "must share one dtype"),
        (lambda: (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5)), "bias has last dim 5"),
        (lambda: (torch.randint(0, 3, (2, 8)), torch.randn(4, 8), None), "x has dtype int64"),
        (lambda: (torch.randn(2, 8), torch.randn(8), None), "weight must have 2 dims"),
    ],
)
def test_linear_rejects_bad_input(make, message):
    x, w, bias = make()
    with pytest.raises(ValueError, match=message):
        kiln.ops.linear(x, w, bias)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [{"M": 1, "N": 4096, "K": 4096}, {"M": 300, "N": 577, "K": 1000, "bias": True}]
)
def test_linear_bfloat16_on_gpu(shape):
    case = run_case(LINEAR, "triton", shape, torch.bfloat16, torch.device("cuda"), seed())
    assert case.passed, case
