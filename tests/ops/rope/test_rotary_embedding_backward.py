"""Backward of rotary_embedding (torch.ops.kiln.rotary_embedding_functional): rotation by -theta with
the forward kernel, against autograd through the float64 reference, and gradcheck."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops.autograd import rotary_embedding
from kiln.ops.rope.rotary_embedding.spec import rotary_embedding_reference
from tests.ops.autograd_checks import GRAD_TOLERANCE, grad_errors


def _reference(positions, cache, is_neox):
    def rotate(q, k):  # the reference rotates in place: on copies, so autograd sees the leaves
        return rotary_embedding_reference(positions, q.clone(), k.clone(), cache.double(), is_neox)

    return rotate


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox,rotary_dim", [(True, 32), (False, 18)])  # full and partial rotary
def test_rotary_backward_matches_float64_autograd(is_neox, rotary_dim, dtype, backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    tokens = 7
    positions = torch.randint(0, 100, (tokens,), generator=g).to(device)
    cache = kiln.ops.rope_cos_sin_cache(rotary_dim, 100, device=device)
    q = torch.randn(tokens, 6, 32, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(tokens, 2, 32, generator=g).to(device=device, dtype=dtype)
    errors = grad_errors(
        lambda q, k: rotary_embedding(positions, q, k, cache, is_neox),
        _reference(positions.cpu(), cache.cpu(), is_neox),
        [q, k],
    )
    assert max(errors) <= GRAD_TOLERANCE[dtype], errors


def test_rotary_backward_gradcheck_float64(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "reference")
    positions = torch.tensor([5, 0, 9])
    cache = kiln.ops.rope_cos_sin_cache(6, 16).double()
    q = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 1, 8, dtype=torch.float64, requires_grad=True)
    for is_neox in (True, False):

        def rotate(q, k, is_neox=is_neox):
            return rotary_embedding(positions, q, k, cache, is_neox)

        assert torch.autograd.gradcheck(rotate, (q, k))
