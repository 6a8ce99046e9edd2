"""The public kiln.ops functions run kernels without a backward: an input that requires grad used to
run, return an output that required grad, and leave the gradient None after .backward() (a warning at
best), silently freezing whatever the user trains. They refuse such a call and name the
differentiable entry point; the custom ops with an autograd formula still differentiate."""

import pytest
import torch

import kiln.ops
from kiln.ops.autograd import silu_and_mul as silu_and_mul_differentiable


def _calls():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g, requires_grad=True)
    q = torch.randn(5, 2, 64, generator=g, requires_grad=True)
    k, v = torch.randn(5, 1, 64, generator=g), torch.randn(5, 1, 64, generator=g)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    return {
        "rms_norm": (lambda: kiln.ops.rms_norm(x, torch.ones(8)), "kiln.ops.autograd.rms_norm"),
        "silu_and_mul": (lambda: kiln.ops.silu_and_mul(x), "kiln.ops.autograd.silu_and_mul"),
        "flash_attention": (
            lambda: kiln.ops.flash_attention(q, k, v, cu, cu, 5, 5),
            "kiln.ops.autograd.flash_attention",
        ),
        "linear": (lambda: kiln.ops.linear(torch.randn(2, 8), x), "inference-only"),
    }


@pytest.mark.parametrize("name", sorted(_calls()))
def test_a_public_op_refuses_inputs_that_need_a_gradient_and_names_what_to_use(name):
    call, hint = _calls()[name]
    with pytest.raises(RuntimeError, match=f"kiln.ops.{name}: an input requires grad") as raised:
        call()
    assert hint in str(raised.value)
    with torch.no_grad():
        out = call()
    assert not out.requires_grad


def test_the_custom_op_with_an_autograd_formula_still_differentiates():
    x = torch.randn(4, 10, requires_grad=True)
    torch.ops.kiln.silu_and_mul(x).square().sum().backward()
    got, x.grad = x.grad, None
    silu_and_mul_differentiable(x).square().sum().backward()
    torch.testing.assert_close(got, x.grad)
