import dataclasses
import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.registry import Implementation
from kiln.ops.softmax.softmax import SOFTMAX
from kiln.verify import assert_close, run_case


def _seed():
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"rows": 1, "cols": 1},
        {"rows": 3, "cols": 777, "masked": True},
        {"rows": 2, "cols": 8193, "temperature": 0.6},  # one past the single-block limit
        {"rows": 2, "cols": 20011, "masked": True, "temperature": 1.3},
    ],
)
def test_softmax_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(SOFTMAX, backend, shape, dtype, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_softmax_over_a_llama3_vocabulary_row(backend, device):
    shape = {"rows": 2, "cols": 128256, "temperature": 0.7}
    case = run_case(SOFTMAX, backend, shape, torch.float32, device, seed=_seed())
    assert case.passed, case


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 30), cols=st.integers(1, 12000), masked=st.booleans(), temperature=st.floats(0.2, 3.0)
)
def test_softmax_triton_fuzzed_shapes(rows, cols, masked, temperature, device):
    shape = {"rows": rows, "cols": cols, "masked": masked, "temperature": temperature}
    case = run_case(SOFTMAX, "triton", shape, torch.float32, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_softmax_long_row_whose_first_blocks_are_all_masked_and_max_comes_last(backend, device, monkeypatch):
    # Online softmax: lanes that have only seen -inf must not turn into NaN, and the running sum
    # must be rescaled when the max keeps growing block after block.
    monkeypatch.setenv("KILN_BACKEND", backend)
    cols = 3 * 4096 + 77
    x = torch.linspace(-20.0, 20.0, cols, dtype=torch.float64).repeat(2, 1)
    x[:, : 2 * 4096 + 5] = float("-inf")
    out = kiln.ops.softmax(x.float().to(device), temperature=0.9)
    ref = torch.softmax(x.float().double() / 0.9, dim=-1)
    assert_close(out, ref, 1e-5)
    assert bool((out[:, : 2 * 4096 + 5] == 0).all())


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("cols", [100, 9000])
@pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning"
)  # the interpreter's -inf - -inf
def test_softmax_of_an_all_masked_row_is_nan_like_torch(backend, cols, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    x = torch.randn(3, cols, device=device)
    x[1] = float("-inf")
    out = kiln.ops.softmax(x)
    assert bool(out[1].isnan().all())
    assert_close(out[[0, 2]], torch.softmax(x[[0, 2]].double(), -1), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_softmax_non_contiguous_3d_input(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    x = torch.randn(4, 301, 3, device=device).transpose(1, 2)  # [4, 3, 301], last-dim stride 3
    out = kiln.ops.softmax(x, 2.0)
    assert out.shape == x.shape
    assert_close(out, torch.softmax(x.double() / 2.0, -1), 1e-5)


@pytest.mark.parametrize(
    "x, temperature, message",
    [
        (torch.randn(2, 8), 0.0, "temperature must be a positive finite float"),
        (torch.randn(2, 8), -1.0, "temperature must be a positive finite float"),
        (torch.randn(2, 8), float("inf"), "temperature must be a positive finite float"),
        (torch.randint(0, 3, (2, 8)), 1.0, "x has dtype int64"),
        (torch.randn(2, 0), 1.0, "last dim .* must be non-empty"),
        (torch.tensor(1.0), 1.0, "x must have at least 1 dims"),
    ],
)
def test_softmax_rejects_bad_input(x, temperature, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.softmax(x, temperature)


def test_softmax_tuning_configs_of_each_block_size_are_correct(device):
    shape = {"rows": 3, "cols": 3000, "masked": True, "temperature": 0.8}
    impl = SOFTMAX.implementations["triton"]
    configs = impl.configs(shape, torch.float32)
    by_block = {c["BLOCK_N"]: c for c in configs}  # one per block size (the tiling changes, warps do not)
    assert len(by_block) >= 3, configs
    for config in by_block.values():
        pinned = Implementation("pinned", functools.partial(impl.fn, config=config))
        spec = dataclasses.replace(SOFTMAX, implementations={"pinned": pinned})
        case = run_case(spec, "pinned", shape, torch.float32, device, seed=_seed())
        assert case.passed, (config, case)


def test_softmax_rejects_a_malformed_config(device):
    impl = SOFTMAX.implementations["triton"]
    inputs = SOFTMAX.make_inputs(
        {"rows": 3, "cols": 3000, "masked": True, "temperature": 0.8},
        torch.float32,
        device,
        torch.Generator().manual_seed(0),
    )
    with pytest.raises(ValueError, match="softmax: config .* needs BLOCK_N a power of two"):
        impl.fn(**inputs, config={"BLOCK_N": 48, "num_warps": 4})


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [{"rows": 64, "cols": 128256, "temperature": 0.7}, {"rows": 5, "cols": 1000}]
)
def test_softmax_bfloat16_on_gpu(shape):
    case = run_case(SOFTMAX, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=_seed())
    assert case.passed, case
