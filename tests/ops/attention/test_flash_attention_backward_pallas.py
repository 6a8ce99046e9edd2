"""flash_attention_backward's JAX backends (the Pallas TPU kernels in the TPU interpreter on the CPU,
the Pallas GPU kernels in the Pallas interpreter, and XLA) through the op's torch-facing
implementation (varlen rows gathered into a padded batch and back), against the spec's float64
reference (autograd through the forward reference), outputs poisoned first; the GPU kernels over
several blocks against XLA, and their Triton lowering."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kiln.ops import get_op  # noqa: E402
from kiln.ops.attention.flash_attention_backward.pallas_gpu import (  # noqa: E402
    flash_attention_backward_padded_pallas_gpu,
)
from kiln.ops.attention.flash_attention_backward.xla import flash_attention_backward_padded_xla  # noqa: E402
from kiln.ops.attention.jax_common import attend_padded  # noqa: E402
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


BACKWARD_SHAPES = [
    GQA_VARLEN_GRAD_LSE,
    # window + soft-cap, GQA 2, head_dim 80 (padded to 128 on the GPU)
    {"seqlens_q": [29], "seqlens_k": [29], "num_heads": 4, "num_kv_heads": 2, "head_dim": 80,
     "sliding_window": 7, "softcap": 5.0},
    # non-causal, more keys than queries, head_dim 32
    {"seqlens_q": [18, 3], "seqlens_k": [40, 33], "num_heads": 2, "num_kv_heads": 2, "head_dim": 32,
     "causal": False},
    # more queries than keys: the first 13 see no key (lse -inf, zero gradients)
    {"seqlens_q": [20], "seqlens_k": [7], "num_heads": 2, "num_kv_heads": 1, "head_dim": 64,
     "grad_lse": True},
]  # fmt: skip
# each backend takes the shapes in these dtypes (the half-precision pair swapped between them)
BACKWARD_DTYPES = {
    "xla": (torch.float32, torch.bfloat16, torch.float16, torch.float32),
    "pallas_gpu": (torch.float32, torch.float16, torch.bfloat16, torch.float32),
}


@pytest.mark.parametrize(
    "backend, dtype, shape",
    [
        (backend, dtype, shape)
        for backend, dtypes in BACKWARD_DTYPES.items()
        for dtype, shape in zip(dtypes, BACKWARD_SHAPES, strict=True)
    ],
)
def test_flash_attention_backward_xla_and_pallas_gpu_match_float64(backend, dtype, shape):
    """xla: the plain jax.numpy backward (no autodiff: the spec's formulas from the saved LSE);
    pallas_gpu: the dK/dV and dQ Triton kernels, interpreted."""
    op, seed = get_op("flash_attention_backward"), random.randrange(2**31)
    case = run_case(op, backend, shape, dtype, CPU, seed=seed)
    assert case.passed, case


@pytest.mark.parametrize(
    "causal, window, softcap", [(True, None, None), (True, 9, 5.0), (False, None, None), (False, 6, None)]
)
def test_flash_attention_backward_gpu_several_blocks_match_xla(causal, window, softcap):
    """Blocks of 16 over 37 / 20 queries and 45 / 9 keys: several query and key blocks per sequence,
    the key block -> query block ranges of the dK/dV kernel (causal, window, none) at their edges."""
    keys = jax.random.split(jax.random.key(random.randrange(2**31)), 5)
    batch, seq_q, seq_k, heads, kv_heads, head_dim = 2, 37, 45, 6, 2, 48
    q, dout = (jax.random.normal(key, (batch, seq_q, heads, head_dim)) for key in keys[:2])
    k, v = (jax.random.normal(key, (batch, seq_k, kv_heads, head_dim)) for key in keys[2:4])
    q_lens, kv_lens = jnp.array([37, 20], jnp.int32), jnp.array([45, 9], jnp.int32)
    scale = head_dim**-0.5
    out, lse = attend_padded(q, k, v, q_lens, kv_lens, scale, causal, window, softcap)
    grad_lse = jax.random.normal(keys[4], lse.shape)
    args = (dout, q, k, v, out, lse, q_lens, kv_lens, causal, scale, window, softcap, grad_lse)
    got = flash_attention_backward_padded_pallas_gpu(*args, block_q=16, block_k=16)
    want = flash_attention_backward_padded_xla(*args)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-5, name


def test_flash_attention_backward_gpu_kernels_lower_to_triton_in_float32_and_float16(lower_for_gpu):
    # The shared lowering test covers the fuzz shapes in bf16; here fp32 (IEEE dots) and fp16 with
    # a window, a soft-cap, GQA 3 and several blocks.
    def backward(q, k, lse, q_lens, kv_lens):
        return flash_attention_backward_padded_pallas_gpu(
            q, q, k, k, q, lse, q_lens, kv_lens, sliding_window=9, softcap=5.0, grad_lse=lse, block_q=16,
            block_k=32, interpret=False,
        )  # fmt: skip

    lens = jnp.array([40, 3], jnp.int32), jnp.array([70, 30], jnp.int32)
    for dtype in (jnp.float32, jnp.float16):
        q, k = jnp.ones((2, 40, 6, 80), dtype), jnp.ones((2, 70, 2, 80), dtype)
        lower_for_gpu(backward, q, k, jnp.zeros((2, 6, 40), jnp.float32), *lens)
