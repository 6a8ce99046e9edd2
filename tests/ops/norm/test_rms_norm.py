import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.norm.rms_norm import RMS_NORM
from kiln.verify import assert_close, run_case

HALF_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        {"rows": 1, "hidden": 1},
        {"rows": 1, "hidden": 576},
        {"rows": 5, "hidden": 1000, "residual": True},
        {"rows": 2, "hidden": 9001, "residual": True},  # longer than one block: looped path
        {"rows": 3, "hidden": 9001},
    ],
)
def test_rms_norm_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(RMS_NORM, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 40), hidden=st.integers(1, 2500), residual=st.booleans())
def test_rms_norm_triton_fuzzed_shapes(rows, hidden, residual, device):
    shape = {"rows": rows, "hidden": hidden, "residual": residual}
    case = run_case(RMS_NORM, "triton", shape, torch.float32, device, seed=random.randrange(2**31))
    assert case.passed, case


def test_rms_norm_fused_residual_writes_sum_back(device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")
    x = torch.randn(4, 333, device=device)
    residual = torch.randn(4, 333, device=device)
    weight = torch.rand(333, device=device) + 0.5
    expected_sum = x + residual
    out, new_residual = kiln.ops.rms_norm(x, weight, 1e-5, residual=residual)
    assert new_residual.data_ptr() == residual.data_ptr()
    assert_close(residual, expected_sum, 1e-6, "residual written back")
    ref = expected_sum * torch.rsqrt(expected_sum.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    assert_close(out, ref, 1e-5)


def test_rms_norm_non_contiguous_and_3d_input(device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")
    base = torch.randn(3, 50, 2 * 129, device=device)
    x = base[..., ::2]  # stride 2 in the last dim
    weight = torch.randn(129, device=device)
    out = kiln.ops.rms_norm(x, weight)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    assert out.shape == x.shape
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.randn(2, 8), torch.randn(7)), "weight has last dim 7, expected x's hidden size 8"),
        (lambda: (torch.randn(2, 8), torch.randn(8, dtype=torch.float16)), "must share one dtype"),
        (lambda: (torch.randint(0, 3, (2, 8)), torch.randn(8)), "x has dtype int64"),
        (lambda: (torch.randn(2, 8), torch.randn(2, 8)), "weight must have 1 dims"),
    ],
)
def test_rms_norm_rejects_bad_input(make, message):
    x, weight = make()
    with pytest.raises(ValueError, match=message):
        kiln.ops.rms_norm(x, weight)


def test_rms_norm_rejects_mismatched_residual():
    with pytest.raises(ValueError, match="residual has shape"):
        kiln.ops.rms_norm(torch.randn(2, 8), torch.randn(8), residual=torch.randn(3, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [{"rows": 7, "hidden": 4096, "residual": True}, {"rows": 1, "hidden": 576}])
def test_rms_norm_bfloat16_on_gpu(shape):
    case = run_case(
        RMS_NORM, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=random.randrange(2**31)
    )
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        {"rows": 15, "hidden": 64, "offset": True},  # per-head q/k norm: [T * H, head_dim]
        {"rows": 3, "hidden": 1000, "residual": True, "offset": True},
        {"rows": 2, "hidden": 9001, "residual": True, "offset": True},  # looped path
    ],
)
def test_rms_norm_weight_offset_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(RMS_NORM, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_rms_norm_weight_offset_one_matches_transformers_gemma3_norm(backend, device, monkeypatch):
    """Gemma's (1 + weight) norm, the offset added in float32: bfloat16 weights near 0 give what
    transformers' Gemma3RMSNorm gives, not the coarser bfloat16 rounding of 1 + weight."""
    modeling = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    monkeypatch.setenv("KILN_BACKEND", backend)
    hidden = 96
    norm = modeling.Gemma3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.01 * torch.randn(hidden))
    x = torch.randn(7, hidden, dtype=torch.float32)
    weight = norm.weight.detach().to(device)
    ref = norm(x)
    out = kiln.ops.rms_norm(x.to(device), weight, 1e-6, weight_offset=1.0).cpu()
    assert_close(out, ref, 1e-5, "float32 Gemma norm")
    # fp32 activations with a weight in bfloat16 storage is the bf16 checkpoint case: HF adds
    # 1 in float32 as we do; rounding 1 + w to bfloat16 first would be off by ~2^-9.
    norm_bf16 = norm.to(torch.bfloat16)
    x16 = x.to(torch.bfloat16)
    ref16 = norm_bf16(x16)
    out16 = kiln.ops.rms_norm(x16.to(device), norm_bf16.weight.detach().to(device), 1e-6, weight_offset=1.0)
    assert_close(out16.cpu().float(), ref16.float(), 1e-2, "bfloat16 Gemma norm")


def test_rms_norm_rejects_non_finite_weight_offset():
    with pytest.raises(ValueError, match="weight_offset must be a finite number"):
        kiln.ops.rms_norm(torch.randn(2, 8), torch.randn(8), weight_offset=float("nan"))
