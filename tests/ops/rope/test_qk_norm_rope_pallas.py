"""qk_norm_rope's JAX backends (TPU interpreter, the Pallas Triton kernel in the Pallas interpreter,
XLA) against the spec's float64 reference, kiln.jax.qk_norm_rope, and the kernels' Mosaic and Triton
lowerings."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.rope.qk_norm_rope.pallas_gpu import qk_norm_rope_pallas_gpu  # noqa: E402
from kiln.ops.rope.qk_norm_rope.pallas_tpu import qk_norm_rope_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")
SHAPES = [
    {"tokens": 7, "q_heads": 4, "kv_heads": 1, "head_dim": 80, "rotary_dim": 34, "is_neox": False},
    {"tokens": 5, "q_heads": 6, "kv_heads": 3, "head_dim": 64},  # NeoX, full rotary (Qwen3)
]
# Pallas Triton: rows padded to a power of two with a partial NeoX rotary (two masked runs and the
# normalized tail), and the smallest head (one pair, one-lane runs).
GPU_SHAPES = [
    {"tokens": 3, "q_heads": 3, "kv_heads": 2, "head_dim": 96, "rotary_dim": 10},
    {"tokens": 2, "q_heads": 1, "kv_heads": 1, "head_dim": 2},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu", "xla"])
@pytest.mark.parametrize("shape", SHAPES)
def test_qk_norm_rope_jax_backends_match_the_specs_float64_reference(shape, backend, dtype):
    case = run_case(get_op("qk_norm_rope"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_qk_norm_rope_pallas_gpu_padded_rows_match_the_specs_float64_reference(shape, dtype):
    case = run_case(get_op("qk_norm_rope"), "pallas_gpu", shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
def test_qk_norm_rope_torch_adapter_writes_q_and_k_in_place(backend):
    positions = torch.tensor([3, 0, 9])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    qw, kw = torch.rand(16) + 0.5, torch.rand(16) + 0.5
    cache = torch.randn(10, 12)
    q_ref, k_ref = q.clone(), k.clone()
    get_op("qk_norm_rope").reference(positions, q_ref, k_ref, qw, kw, cache, 1e-6, True)
    out_q, out_k = get_op("qk_norm_rope").implementation(backend).fn(positions, q, k, qw, kw, cache)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
def test_qk_norm_rope_kiln_jax_under_jit_equals_rms_norm_then_rotary_embedding(implementation):
    positions = jnp.array([5, 0, 2], jnp.int32)
    q = jax.random.normal(jax.random.key(0), (3, 4, 32), jnp.float32)
    k = jax.random.normal(jax.random.key(1), (3, 2, 32), jnp.float32)
    qw, kw = jnp.linspace(0.5, 1.5, 32), jnp.linspace(1.5, 0.5, 32)
    cache = kjax.rope_cos_sin_cache(24, 8)
    got = jax.jit(lambda *a: kjax.qk_norm_rope(*a, implementation=implementation))(
        positions, q, k, qw, kw, cache
    )
    normed = [kjax.rms_norm(x, w, 1e-6, implementation="xla") for x, w in ((q, qw), (k, kw))]
    want = kjax.rotary_embedding(positions, *normed, cache, implementation="xla")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_qk_norm_rope_kiln_jax_with_no_tokens_returns_q_and_k():
    q, k, w = jnp.ones((0, 2, 8)), jnp.ones((0, 1, 8)), jnp.ones((8,))
    for implementation in ("pallas_gpu", "pallas_tpu", "xla"):
        out_q, out_k = kjax.qk_norm_rope(
            jnp.zeros((0,), jnp.int32), q, k, w, w, jnp.ones((4, 8)), implementation=implementation
        )
        assert out_q.shape == q.shape and out_k.shape == k.shape


def test_qk_norm_rope_kiln_jax_rejects_bad_input():
    with pytest.raises(ValueError, match="k_weight has last dim 6, expected q's head_dim 8"):
        kjax.qk_norm_rope(
            jnp.zeros((3,), jnp.int32), jnp.ones((3, 2, 8)), jnp.ones((3, 1, 8)), jnp.ones((8,)),
            jnp.ones((6,)), jnp.ones((9, 8)),
        )  # fmt: skip


def test_qk_norm_rope_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    q, k = jnp.ones((5, 4, 128), jnp.bfloat16), jnp.ones((5, 1, 128), jnp.bfloat16)
    w = jnp.ones((128,), jnp.bfloat16)
    positions, cache = jnp.arange(5, dtype=jnp.int32), kjax.rope_cos_sin_cache(128, 16)

    def lower(p, a, b, qw, kw, c):
        return qk_norm_rope_pallas_tpu(p, a, b, qw, kw, c, interpret=False)

    lower_for_tpu(lower, positions, q, k, w, w, cache)


@pytest.mark.parametrize("is_neox", [False, True])
def test_qk_norm_rope_gpu_kernel_lowers_to_triton(lower_for_gpu, is_neox):
    # The shared lowering test's fuzz shapes are NeoX with full rotary: GPT-J pairs here too, and a
    # partial rotary_dim (a padded row and masked runs), in float16.
    q, k = jnp.ones((5, 4, 80), jnp.float16), jnp.ones((5, 1, 80), jnp.float16)
    w = jnp.ones((80,), jnp.float16)
    positions, cache = jnp.arange(5, dtype=jnp.int32), kjax.rope_cos_sin_cache(34, 16)

    def lower(p, a, b, qw, kw, c):
        return qk_norm_rope_pallas_gpu(p, a, b, qw, kw, c, is_neox=is_neox, interpret=False)

    lower_for_gpu(lower, positions, q, k, w, w, cache)
