"""Backward passes for Kiln's ops, registered with torch.library so eager autograd and
torch.compile(fullgraph=True) both differentiate through the kernels.

    functional ops given an autograd formula:  torch.ops.kiln.silu_and_mul, .gelu_tanh_and_mul,
        .layer_norm, .softmax, .fused_linear_cross_entropy, .flash_attention_with_lse
    functional twins of the in-place ops (torch.library only differentiates functional ops):
        torch.ops.kiln.rms_norm_functional, .add_rms_norm_functional, .rotary_embedding_functional

Each backward has a Triton kernel (CUDA, or the interpreter with KILN_BACKEND=triton) and a plain
torch path (every other device, float64 included, so torch.autograd.gradcheck applies). The
functions below (functional.py) are the entry points training code calls.
"""

from kiln.ops.autograd import (  # noqa: F401  (register the formulas)
    attention_backward,
    cross_entropy_backward,
    gated_backward,
    norm_backward,
    rotary_backward,
    softmax_backward,
)
from kiln.ops.autograd.functional import (
    flash_attention,
    fused_linear_cross_entropy_loss,
    gelu_tanh_and_mul,
    layer_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    softmax,
)

__all__ = [
    "flash_attention",
    "fused_linear_cross_entropy_loss",
    "gelu_tanh_and_mul",
    "layer_norm",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "softmax",
]
