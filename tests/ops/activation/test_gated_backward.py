"""Backward of silu_and_mul and gelu_tanh_and_mul (torch.ops.kiln.*, kiln.ops.autograd): the Triton
kernel and the torch path against autograd through the float64 reference, and gradcheck."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops.autograd import gelu_tanh_and_mul, silu_and_mul
from tests.ops.autograd_checks import GRAD_TOLERANCE, grad_errors

OPS = {"silu_and_mul": silu_and_mul, "gelu_tanh_and_mul": gelu_tanh_and_mul}


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", list(OPS))
def test_gated_backward_matches_float64_autograd(op, dtype, backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = (torch.randn(7, 2 * 1029, generator=g) * 2.0).to(device=device, dtype=dtype)  # d past one block
    reference = getattr(kiln.ops, op).spec.reference
    (error,) = grad_errors(OPS[op], reference, [x])
    assert error <= GRAD_TOLERANCE[dtype], error


@pytest.mark.parametrize("op", list(OPS))
def test_gated_backward_gradcheck_float64(op, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "reference")  # a float64 forward for the finite differences
    x = torch.randn(3, 2, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(OPS[op], (x,))


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_gelu_tanh_backward_keeps_float32_precision_for_negative_gates(backend, device, monkeypatch):
    # 1 + tanh(z) cancels in float32 for gates below about -3 (1e-4 relative at -4): the backward must
    # not form it. Gates in [-6, -3] only, so that no well-conditioned element hides the error.
    monkeypatch.setenv("KILN_BACKEND", backend)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    gate = -3.0 - 3.0 * torch.rand(5, 64, generator=g)
    x = torch.cat([gate, torch.randn(5, 64, generator=g)], dim=-1).to(device)
    (error,) = grad_errors(gelu_tanh_and_mul, kiln.ops.gelu_tanh_and_mul.spec.reference, [x])
    assert error <= 1e-5, error
