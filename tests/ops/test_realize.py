import torch
from torch._inductor.utils import run_and_get_code

from kiln.ops.realize import realized


def test_realized_is_the_identity_eagerly_and_a_buffer_inductor_cannot_inline():
    """Eager: x itself. Compiled: the same values, and the generated code calls the complex-view pair
    that makes inductor compute x into a buffer once (were PyTorch to lower those views itself, the
    barrier would be gone and this fails)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 10, generator=g), torch.randn(50, 10, generator=g)
    assert realized(x) is x

    def gemv(x):
        h = torch.nn.functional.rms_norm(x * 2.0 + 1.0, (10,))
        return (realized(h)[:, None, :] * w).sum(-1)

    torch._dynamo.reset()
    compiled, codes = run_and_get_code(torch.compile(gemv, fullgraph=True), x)
    torch.testing.assert_close(compiled, gemv(x), rtol=1e-6, atol=1e-6)
    assert any("view_as_complex" in code for code in codes)


def test_realized_passes_through_what_has_no_complex_view():
    """An odd element count or a half dtype: x unchanged, traced too."""
    for x in (torch.randn(3, 5), torch.randn(4, 6).to(torch.bfloat16)):
        assert realized(x) is x
        torch._dynamo.reset()
        out = torch.compile(lambda t: realized(t) * 1.0, fullgraph=True)(x)
        assert torch.equal(out, x * 1.0)
