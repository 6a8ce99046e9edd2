"""flash_attention_backward's JAX backends (the Pallas TPU kernels in the TPU interpreter on the CPU,
and XLA) through the op's torch-facing implementation (varlen rows gathered into a padded batch and
back), against the spec's float64 reference (autograd through the forward reference), outputs
poisoned first."""

import random

import pytest
import torch

pytest.importorskip("jax")

from kiln.ops import get_op  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")

GQA_VARLEN_GRAD_LSE = {  # three sequences, bottom-right causal, a gradient on the LSE too
    "seqlens_q": [33, 5, 1],
    "seqlens_k": [33, 21, 19],
    "num_heads": 3,
    "num_kv_heads": 1,
    "head_dim": 64,
    "grad_lse": True,
}


def test_flash_attention_backward_pallas_tpu_matches_float64():
    """One case (interpret mode compiles slowly); kiln.jax's tests cover windows, soft-caps, bf16 and
    several blocks, and `kiln verify --op flash_attention_backward --backend pallas_tpu` the fuzz shapes."""
    op, seed = get_op("flash_attention_backward"), random.randrange(2**31)
    case = run_case(op, "pallas_tpu", GQA_VARLEN_GRAD_LSE, torch.float32, CPU, seed=seed)
    assert case.passed, case


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (torch.float32, GQA_VARLEN_GRAD_LSE),
        (  # window + soft-cap, GQA 2
            torch.bfloat16,
            {"seqlens_q": [29], "seqlens_k": [29], "num_heads": 4, "num_kv_heads": 2, "head_dim": 80,
             "sliding_window": 7, "softcap": 5.0},
        ),
        (  # non-causal, more keys than queries
            torch.float16,
            {"seqlens_q": [18, 3], "seqlens_k": [40, 33], "num_heads": 2, "num_kv_heads": 2, "head_dim": 32,
             "causal": False},
        ),
        (  # more queries than keys: the first 13 see no key (lse -inf, zero gradients)
            torch.float32,
            {"seqlens_q": [20], "seqlens_k": [7], "num_heads": 2, "num_kv_heads": 1, "head_dim": 64,
             "grad_lse": True},
        ),
    ],
)  # fmt: skip
def test_flash_attention_backward_xla_matches_float64(dtype, shape):
    """The plain jax.numpy backward (no autodiff: the spec's formulas from the saved LSE)."""
    op, seed = get_op("flash_attention_backward"), random.randrange(2**31)
    case = run_case(op, "xla", shape, dtype, CPU, seed=seed)
    assert case.passed, case
