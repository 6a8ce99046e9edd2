import dataclasses
import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.activation.silu_and_mul import SILU_AND_MUL
from kiln.ops.registry import Implementation
from kiln.verify import assert_close, run_case


def _seed():
    return random.randrange(2**31)


def _textbook(x):
    """silu(gate) * up in float64 from the formula x * sigmoid(x) (not the reference's F.silu)."""
    gate, up = x.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [{"rows": 1, "d": 1}, {"rows": 9, "d": 4321}, {"rows": 65, "d": 3}, {"rows": 2, "d": 1536}]
)
def test_silu_and_mul_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(SILU_AND_MUL, backend, shape, dtype, device, seed=_seed())
    assert case.passed, case


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 50), d=st.integers(1, 3000))
def test_silu_and_mul_triton_fuzzed_shapes(rows, d, device):
    case = run_case(SILU_AND_MUL, "triton", {"rows": rows, "d": d}, torch.float32, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(120) = inf is intended
def test_silu_and_mul_matches_textbook_formula_and_saturates_without_nan(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    gate = torch.cat([torch.linspace(-120.0, 120.0, 301), torch.randn(300)])  # far into both tails
    x = torch.cat([gate, torch.randn(601)]).repeat(3, 1)
    out = kiln.ops.silu_and_mul(x.to(device))
    assert out.shape == (3, 601)
    assert_close(out, _textbook(x), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_silu_and_mul_non_contiguous_3d_input(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    x = torch.randn(2, 2 * 77, 5, device=device).transpose(1, 2)  # [2, 5, 154], last-dim stride 5
    out = kiln.ops.silu_and_mul(x)
    assert out.shape == (2, 5, 77)
    assert_close(out, _textbook(x), 1e-5)


@pytest.mark.parametrize(
    "x, message",
    [
        (torch.randn(3, 7), "x has last dim 7, expected an even size 2\\*d"),
        (torch.randint(0, 5, (3, 8)), "x has dtype int64"),
        (torch.tensor(2.0), "x must have at least 1 dims"),
        ([1.0, 2.0], "x must be a torch.Tensor"),
    ],
)
def test_silu_and_mul_rejects_bad_input(x, message):
    with pytest.raises(ValueError, match=f"silu_and_mul: {message}"):
        kiln.ops.silu_and_mul(x)


def test_silu_and_mul_tuning_configs_of_each_block_size_are_correct(device):
    shape = {"rows": 3, "d": 700}
    impl = SILU_AND_MUL.implementations["triton"]
    configs = impl.configs(shape, torch.float32)
    by_block = {c["BLOCK_D"]: c for c in configs}  # one per block size (the tiling changes, warps do not)
    assert len(by_block) >= 3, configs
    for config in by_block.values():
        pinned = Implementation("pinned", functools.partial(impl.fn, config=config))
        spec = dataclasses.replace(SILU_AND_MUL, implementations={"pinned": pinned})
        case = run_case(spec, "pinned", shape, torch.float32, device, seed=_seed())
        assert case.passed, (config, case)


def test_silu_and_mul_rejects_a_malformed_config(device):
    impl = SILU_AND_MUL.implementations["triton"]
    inputs = SILU_AND_MUL.make_inputs(
        {"rows": 3, "d": 700}, torch.float32, device, torch.Generator().manual_seed(0)
    )
    with pytest.raises(ValueError, match="silu_and_mul: config .* needs BLOCK_D a power of two"):
        impl.fn(**inputs, config={"BLOCK_D": 48, "num_warps": 4})


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [{"rows": 64, "d": 14336}, {"rows": 3, "d": 1537}])
def test_silu_and_mul_bfloat16_on_gpu(shape):
    case = run_case(SILU_AND_MUL, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=_seed())
    assert case.passed, case
