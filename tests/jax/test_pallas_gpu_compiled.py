"""On a GPU with a CUDA jaxlib: the pallas_gpu kernels compiled by Triton (not interpreted), on CUDA
torch tensors through DLPack, against the float64 references. Skipped elsewhere."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")

from kiln.ops import get_op  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CASES = [
    ("rms_norm", {"rows": 7, "hidden": 4096, "residual": True}, torch.bfloat16),
    ("softmax", {"rows": 5, "cols": 49152, "temperature": 0.7}, torch.float32),
    ("silu_and_mul", {"rows": 9, "d": 4321}, torch.float16),
    ("linear", {"M": 65, "N": 300, "K": 700, "bias": True}, torch.bfloat16),
    ("linear", {"M": 17, "N": 33, "K": 77}, torch.float32),
    ("w8a16_linear", {"M": 16, "N": 512, "K": 576}, torch.bfloat16),
    (
        "flash_attention",
        {
            "seqlens_q": [37, 5, 1],
            "seqlens_k": [37, 21, 19],
            "num_heads": 4,
            "num_kv_heads": 1,
            "head_dim": 64,
        },
        torch.bfloat16,
    ),
    (
        "flash_attention_with_lse",
        {
            "seqlens_q": [29],
            "seqlens_k": [29],
            "num_heads": 8,
            "num_kv_heads": 1,
            "head_dim": 128,
            "sliding_window": 7,
            "softcap": 5.0,
        },
        torch.float16,
    ),  # fmt: skip
]


@pytest.mark.gpu
@pytest.mark.parametrize("op, shape, dtype", CASES)
def test_pallas_gpu_compiled_on_cuda_matches_float64(op, shape, dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("jax has no GPU backend here (CPU-only jaxlib)")
    case = run_case(
        get_op(op), "pallas_gpu", shape, dtype, torch.device("cuda"), seed=random.randrange(2**31)
    )
    assert case.passed, case
