import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.activation.gelu_tanh_and_mul import GELU_TANH_AND_MUL
from kiln.verify import assert_close, run_case


def _seed():
    return random.randrange(2**31)


def _textbook(x):
    """gelu_tanh(gate) * up in float64 from the formula 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    (not the reference's F.gelu)."""
    gate, up = x.double().chunk(2, dim=-1)
    return 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [{"rows": 1, "d": 1}, {"rows": 9, "d": 4321}, {"rows": 65, "d": 3}, {"rows": 2, "d": 1536}]
)
def test_gelu_tanh_and_mul_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(GELU_TANH_AND_MUL, backend, shape, dtype, device, seed=_seed())
    assert case.passed, case


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 50), d=st.integers(1, 3000))
def test_gelu_tanh_and_mul_triton_fuzzed_shapes(rows, d, device):
    case = run_case(GELU_TANH_AND_MUL, "triton", {"rows": rows, "d": d}, torch.float32, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(120) = inf is intended
def test_gelu_tanh_and_mul_matches_textbook_formula_and_saturates_without_nan(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    gate = torch.cat([torch.linspace(-120.0, 120.0, 301), torch.randn(300)])  # far into both tails
    x = torch.cat([gate, torch.randn(601)]).repeat(3, 1)
    out = kiln.ops.gelu_tanh_and_mul(x.to(device))
    assert out.shape == (3, 601)
    assert_close(out, _textbook(x), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_gelu_tanh_and_mul_non_contiguous_3d_input(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    x = torch.randn(2, 2 * 77, 5, device=device).transpose(1, 2)  # [2, 5, 154], last-dim stride 5
    out = kiln.ops.gelu_tanh_and_mul(x)
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
def test_gelu_tanh_and_mul_rejects_bad_input(x, message):
    with pytest.raises(ValueError, match=f"gelu_tanh_and_mul: {message}"):
        kiln.ops.gelu_tanh_and_mul(x)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [{"rows": 64, "d": 14336}, {"rows": 3, "d": 1537}])
def test_gelu_tanh_and_mul_bfloat16_on_gpu(shape):
    case = run_case(GELU_TANH_AND_MUL, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp16: these outputs are subnormal
def test_gelu_tanh_cpu_path_has_no_cancellation_in_the_negative_tail(dtype):
    # PyTorch's gelu(approximate="tanh") computes 1 + tanh(z): 30% relative error at a = -5 in float32.
    gate = torch.tensor([-5.0, -4.0, -6.5, -3.0])
    x = torch.cat([gate, torch.full((4,), 1.5)]).to(dtype)[None, :]
    out = GELU_TANH_AND_MUL.implementation("cpu").fn(x)
    g = x[:, :4].double()
    ref = g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)) * x[:, 4:].double()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    for i in range(4):  # each element on its own: the tail values are tiny next to gelu(-3)
        assert_close(out[:, i], ref[:, i], tol, f"gate {gate[i].item()}")


def test_gelu_tanh_cpu_path_keeps_float64_inputs_in_float64():
    x = torch.randn(3, 2 * 40, dtype=torch.float64)
    out = GELU_TANH_AND_MUL.implementation("cpu").fn(x)
    assert out.dtype == torch.float64
    assert_close(out, _textbook(x), 1e-12, "float64 input")


def test_the_float64_reference_has_no_cancellation_in_the_negative_tail():
    """The verifier's reference (what every backend is checked against) against 200-digit arithmetic:
    F.gelu(approximate="tanh") in float64 is 1.5e-4 off at a gate of -6.5 (1 + tanh(z) cancels), which
    failed a correct float32 kernel's single-element case."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 200  # 1 + tanh(z) is ~1e-62 at a gate of -12
    gate = [-6.5005, -12.0, -3.0, -0.5, 2.0]
    x = torch.tensor([gate + [1.5] * len(gate)], dtype=torch.float64)
    ref = GELU_TANH_AND_MUL.reference(x)[0]
    for i, a in enumerate(gate):
        a = mpmath.mpf(a)
        z = mpmath.sqrt(2 / mpmath.pi) * (a + mpmath.mpf("0.044715") * a**3)
        exact = 0.5 * a * (1 + mpmath.tanh(z)) * 1.5
        assert abs((mpmath.mpf(ref[i].item()) - exact) / exact) < 1e-12, (gate[i], ref[i].item(), exact)
