"""torch.compile(fullgraph=True) differentiates through Kiln's custom ops (the formulas registered by
kiln.ops.autograd), with the same gradients as eager autograd."""

import pytest
import torch

import kiln.ops
from kiln.ops import autograd as ka
from kiln.verify import assert_close


def _block(x, residual, weight, bias, gate_up, q, k, positions, cache):
    y, s = ka.rms_norm(x, weight, 1e-6, residual=residual)
    z = ka.layer_norm(y, weight, bias, 1e-5) + ka.rms_norm(s, weight, 1e-6, weight_offset=1.0)
    act = ka.silu_and_mul(gate_up) + ka.gelu_tanh_and_mul(gate_up)
    q, k = ka.rotary_embedding(positions, q, k, cache)
    return (z * z).sum() + (act * act).sum() + ka.softmax(q.flatten(1), 0.8).pow(2).sum() + (k * k).sum()


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_compiled_block_backpropagates_like_eager(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    g = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(3, 16, generator=g),
        torch.randn(3, 16, generator=g),
        torch.randn(16, generator=g) + 1.0,
        torch.randn(16, generator=g),
        torch.randn(3, 10, generator=g),
        torch.randn(3, 2, 8, generator=g),
        torch.randn(3, 1, 8, generator=g),
    ]
    inputs = [t.to(device) for t in inputs]
    positions = torch.tensor([0, 4, 2], device=device)
    cache = kiln.ops.rope_cos_sin_cache(8, 8, device=device)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        fn(*leaves, positions, cache).backward()
        return [leaf.grad for leaf in leaves]

    torch._dynamo.reset()
    compiled = grads(torch.compile(_block, backend="aot_eager", fullgraph=True))
    for got, expected in zip(compiled, grads(_block), strict=True):
        assert_close(got, expected, 1e-6, "compiled gradient")
