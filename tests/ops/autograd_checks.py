"""What the backward tests share: gradients of a Kiln function against torch.autograd through the
op's float64 reference, on the same (rounded) inputs, with poisoned kernel outputs."""

from __future__ import annotations

import torch

from kiln.ops.alloc import poisoned
from kiln.verify import relative_error

# Gradients: fp32 summation order; halves one rounding of each gradient (as the forward ops).
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def grad_errors(kiln_fn, reference_fn, inputs, seed=0):
    """Relative error of each gradient of sum(out * upstream) over `inputs` (tensors in the test
    dtype, all differentiated). kiln_fn runs on the inputs as they are (KILN_BACKEND as the caller set
    it), reference_fn on float64 copies; both may return a tensor or a tuple of tensors."""
    generator = torch.Generator().manual_seed(seed)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    leaves64 = [t.detach().to(torch.float64).requires_grad_() for t in inputs]
    with poisoned():
        outs = _as_tuple(kiln_fn(*leaves))
    upstream = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in outs]
    with poisoned():
        torch.autograd.backward(outs, [u.to(o.dtype) for u, o in zip(upstream, outs, strict=True)])
    refs = _as_tuple(reference_fn(*leaves64))
    torch.autograd.backward(refs, upstream)
    return [relative_error(a.grad, b.grad) for a, b in zip(leaves, leaves64, strict=True)]


def _as_tuple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
