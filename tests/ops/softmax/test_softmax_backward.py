"""Backward of softmax (torch.ops.kiln.softmax): the Triton kernel and the torch path against
autograd through the float64 reference, and gradcheck."""

import random

import pytest
import torch

from kiln.ops.autograd import softmax
from kiln.ops.softmax.softmax.spec import softmax_reference
from tests.ops.autograd_checks import grad_errors

# The backward reads the forward's output rounded to x's dtype (as torch's softmax backward does):
# halves carry that rounding of y on top of the gradient's own.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols,temperature", [(77, 1.0), (4096 + 9, 0.7)])  # one block, looped
def test_softmax_backward_matches_float64_autograd(cols, temperature, dtype, backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = (torch.randn(3, cols, generator=g) * 3.0).to(device=device, dtype=dtype)
    (error,) = grad_errors(
        lambda x: softmax(x, temperature), lambda x: softmax_reference(x, temperature), [x]
    )
    assert error <= TOLERANCE[dtype], error


def test_softmax_backward_gradcheck_float64(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "reference")
    x = torch.randn(4, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: softmax(x, 1.3), (x,))
