"""Backward of rms_norm (plain, fused residual, weight offset) and layer_norm: the Triton kernels
(per-program partial weight gradients summed after) and the torch paths against autograd through the
float64 references, and gradcheck."""

import random

import pytest
import torch

from kiln.ops.autograd import layer_norm, rms_norm
from kiln.ops.norm.layer_norm.spec import layer_norm_reference
from kiln.ops.norm.rms_norm.spec import rms_norm_reference
from tests.ops.autograd_checks import GRAD_TOLERANCE, grad_errors


def _randn(*shape, g, dtype, device, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=g) * scale + offset).to(device=device, dtype=dtype)


def _add_rms_norm_reference(x, residual, weight, weight_offset=0.0):
    s = x + residual
    return rms_norm_reference(s, weight, 1e-6, None, weight_offset), s


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,weight_offset", [(9, 37, 0.0), (5, 300, 1.0)])
def test_rms_norm_backward_matches_float64_autograd(
    rows, hidden, weight_offset, dtype, backend, device, monkeypatch
):
    monkeypatch.setenv("KILN_BACKEND", backend)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = _randn(rows, hidden, g=g, dtype=dtype, device=device)
    weight = _randn(hidden, g=g, dtype=dtype, device=device, scale=0.5, offset=1.0 - weight_offset)
    errors = grad_errors(
        lambda x, w: rms_norm(x, w, 1e-6, weight_offset=weight_offset),
        lambda x, w: rms_norm_reference(x, w, 1e-6, None, weight_offset),
        [x, weight],
    )
    assert max(errors) <= GRAD_TOLERANCE[dtype], errors


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_residual_rms_norm_backward_sums_both_gradients(dtype, backend, device, monkeypatch):
    # (y, s) = (rms_norm(x + residual), x + residual): grad of x and residual = norm's grad + grad_s.
    monkeypatch.setenv("KILN_BACKEND", backend)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x, residual = (_randn(2, 3, 65, g=g, dtype=dtype, device=device) for _ in range(2))
    weight = _randn(65, g=g, dtype=dtype, device=device, scale=0.5, offset=1.0)
    kept = residual.clone()
    errors = grad_errors(
        lambda x, r, w: rms_norm(x, w, 1e-6, residual=r), _add_rms_norm_reference, [x, residual, weight]
    )
    assert max(errors) <= GRAD_TOLERANCE[dtype], errors
    assert torch.equal(residual, kept)  # the differentiable variant never writes its inputs


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_backward_matches_float64_autograd(bias, dtype, backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = _randn(11, 203, g=g, dtype=dtype, device=device, offset=3.0)  # far from zero mean
    weight = _randn(203, g=g, dtype=dtype, device=device, scale=0.5, offset=1.0)
    inputs = [x, weight] + ([_randn(203, g=g, dtype=dtype, device=device)] if bias else [])
    errors = grad_errors(
        lambda x, w, *b: layer_norm(x, w, *b, eps=1e-5),
        lambda x, w, *b: layer_norm_reference(x, w, *b, eps=1e-5),
        inputs,
    )
    assert max(errors) <= GRAD_TOLERANCE[dtype], errors


def test_norm_backward_gradcheck_float64(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "reference")  # float64 forwards for the finite differences
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x, residual = (torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = (torch.randn(9, generator=g, dtype=torch.float64) + 1).requires_grad_()
    bias = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6, weight_offset=0.5), (x, weight))
    assert torch.autograd.gradcheck(lambda x, r, w: rms_norm(x, w, 1e-6, residual=r), (x, residual, weight))
    assert torch.autograd.gradcheck(lambda x, w, b: layer_norm(x, w, b, 1e-5), (x, weight, bias))
