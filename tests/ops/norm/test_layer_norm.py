import dataclasses
import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.norm.layer_norm import LAYER_NORM
from kiln.ops.registry import Implementation
from kiln.verify import assert_close, run_case


def _seed():
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"rows": 1, "hidden": 2},
        {"rows": 1, "hidden": 576, "bias": False},
        {"rows": 5, "hidden": 1000},
        {"rows": 2, "hidden": 9001},  # longer than one block: the three-pass looped path
        {"rows": 3, "hidden": 9001, "bias": False},
    ],
)
def test_layer_norm_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(LAYER_NORM, backend, shape, dtype, device, seed=_seed())
    assert case.passed, case


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 40), hidden=st.integers(2, 2500), bias=st.booleans())
def test_layer_norm_triton_fuzzed_shapes(rows, hidden, bias, device):
    shape = {"rows": rows, "hidden": hidden, "bias": bias}
    case = run_case(LAYER_NORM, "triton", shape, torch.float32, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("hidden", [700, 9001])
def test_layer_norm_rows_with_a_large_mean_keep_full_precision(backend, hidden, device, monkeypatch):
    # mean 1000, std 1. The float32 mean itself is only good to ~ulp(1000)/2 = 3e-5 (that is a shift
    # of the whole centered row by 3e-5 std), hence 2e-4; a variance taken as E[x^2] - E[x]^2 in
    # float32 loses ~1000^2 * 2^-24 = 6e-2 of the variance and fails this by two orders of magnitude.
    monkeypatch.setenv("KILN_BACKEND", backend)
    x = torch.randn(3, hidden, dtype=torch.float64) + 1000.0
    weight, bias = torch.rand(hidden, dtype=torch.float64) + 0.5, torch.randn(hidden, dtype=torch.float64)
    out = kiln.ops.layer_norm(x.float().to(device), weight.float().to(device), bias.float().to(device))
    ref = torch.nn.functional.layer_norm(
        x.float().double(), (hidden,), weight.float().double(), bias.float().double()
    )
    assert_close(out, ref, 2e-4)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_layer_norm_non_contiguous_3d_input(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    x = torch.randn(3, 2 * 129, 5, device=device).transpose(1, 2)[..., ::2]  # [3, 5, 129], strided
    weight, bias = torch.randn(129, device=device), torch.randn(129, device=device)
    out = kiln.ops.layer_norm(x, weight, bias, eps=1e-5)
    ref = torch.nn.functional.layer_norm(x.double(), (129,), weight.double(), bias.double(), 1e-5)
    assert out.shape == x.shape
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: (torch.randn(2, 8), torch.randn(7), None),
            "weight has last dim 7, expected x's hidden size 8",
        ),
        (lambda: (torch.randn(2, 8), torch.randn(8), torch.randn(9)), "bias has last dim 9"),
        (lambda: (torch.randn(2, 8), torch.randn(8), torch.randn(8).half()), "must share one dtype"),
        (lambda: (torch.randint(0, 3, (2, 8)), torch.randn(8), None), "x has dtype int64"),
        (lambda: (torch.randn(2, 8), torch.randn(2, 8), None), "weight must have 1 dims"),
    ],
)
def test_layer_norm_rejects_bad_input(make, message):
    x, weight, bias = make()
    with pytest.raises(ValueError, match=message):
        kiln.ops.layer_norm(x, weight, bias)


def test_layer_norm_rejects_non_positive_eps():
    with pytest.raises(ValueError, match="layer_norm: eps must be positive"):
        kiln.ops.layer_norm(torch.randn(2, 8), torch.randn(8), None, eps=0.0)


def test_layer_norm_tuning_configs_of_each_block_size_are_correct(device):
    shape = {"rows": 3, "hidden": 2500}
    impl = LAYER_NORM.implementations["triton"]
    configs = impl.configs(shape, torch.float32)
    by_block = {c["BLOCK_N"]: c for c in configs}  # one per block size (the tiling changes, warps do not)
    assert len(by_block) >= 3, configs
    for config in by_block.values():
        pinned = Implementation("pinned", functools.partial(impl.fn, config=config))
        spec = dataclasses.replace(LAYER_NORM, implementations={"pinned": pinned})
        case = run_case(spec, "pinned", shape, torch.float32, device, seed=_seed())
        assert case.passed, (config, case)


def test_layer_norm_rejects_a_malformed_config():
    impl = LAYER_NORM.implementations["triton"]
    inputs = LAYER_NORM.make_inputs(
        {"rows": 3, "hidden": 2500}, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    with pytest.raises(ValueError, match="layer_norm: config .* needs BLOCK_N a power of two"):
        impl.fn(**inputs, config={"BLOCK_N": 48, "num_warps": 4})


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [{"rows": 7, "hidden": 4096}, {"rows": 2, "hidden": 9001, "bias": False}])
def test_layer_norm_bfloat16_on_gpu(shape):
    case = run_case(LAYER_NORM, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=_seed())
    assert case.passed, case
