"""rotary_embedding's JAX backends (TPU interpreter, Pallas GPU interpreter, XLA) against the spec's
float64 reference, and kiln.jax.rotary_embedding / its old name kiln.jax.rope."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.rope.rotary_embedding.pallas_tpu import rotary_embedding_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

# The JAX backends take CPU tensors on any machine (through DLPack; moved to a TPU/GPU if there is one).
CPU = torch.device("cpu")
SHAPES = [
    {"tokens": 7, "q_heads": 4, "kv_heads": 1, "head_dim": 80, "rotary_dim": 34, "is_neox": False},
    {"tokens": 5, "q_heads": 9, "kv_heads": 3, "head_dim": 64},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize("shape", SHAPES)
def test_rotary_embedding_jax_backends_match_the_specs_float64_reference(shape, backend, dtype):
    case = run_case(get_op("rotary_embedding"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


def test_rotary_embedding_torch_adapter_rotates_q_and_k_in_place():
    positions = torch.tensor([3, 0, 9])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cache = torch.randn(10, 12)
    q_ref, k_ref = q.clone(), k.clone()
    get_op("rotary_embedding").reference(positions, q_ref, k_ref, cache, False)
    out_q, out_k = get_op("rotary_embedding").implementation("xla").fn(positions, q, k, cache, False)
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)


def test_kiln_jax_rope_is_rotary_embedding_under_jit_with_implementation_positional():
    positions = jnp.array([5, 0, 2], jnp.int32)
    q = jax.random.normal(jax.random.key(0), (3, 4, 32), jnp.float32)
    k = jax.random.normal(jax.random.key(1), (3, 2, 32), jnp.float32)
    cache = kjax.rope_cos_sin_cache(24, 8)
    want = kjax.rotary_embedding(positions, q, k, cache, False, implementation="xla")
    got = jax.jit(lambda p, a, b, c: kjax.rope(p, a, b, c, False, "pallas_tpu"))(positions, q, k, cache)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(got[0]), np.asarray(q))  # it did rotate


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_pallas_gpu_odd_head_dim_partial_rotary_matches_xla(is_neox):
    # head_dim 81 (odd, padded to 128 in the kernel), rotary_dim 34 (17 pairs masked in 32 lanes).
    positions = jnp.array([5, 0, 2], jnp.int32)
    q = jax.random.normal(jax.random.key(0), (3, 3, 81), jnp.float32)
    k = jax.random.normal(jax.random.key(1), (3, 1, 81), jnp.float32)
    cache = kjax.rope_cos_sin_cache(34, 8)
    want = kjax.rotary_embedding(positions, q, k, cache, is_neox, implementation="xla")
    got = kjax.rotary_embedding(positions, q, k, cache, is_neox, implementation="pallas_gpu")
    for g, w, x in zip(got, want, (q, k), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(g[..., 34:]), np.asarray(x[..., 34:]))  # untouched


def test_rotary_embedding_kiln_jax_with_no_tokens_returns_q_and_k():
    q, k = jnp.ones((0, 2, 8)), jnp.ones((0, 1, 8))
    for implementation in ("pallas_tpu", "pallas_gpu", "xla"):
        out_q, out_k = kjax.rotary_embedding(
            jnp.zeros((0,), jnp.int32), q, k, jnp.ones((4, 8)), implementation=implementation
        )
        assert out_q.shape == q.shape and out_k.shape == k.shape


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: kjax.rope(
                jnp.zeros((3,), jnp.int32), jnp.ones((3, 2, 8)), jnp.ones((3, 1, 6)), jnp.ones((9, 8))
            ),
            "k has head_dim 6, expected q's head_dim 8",
        ),
        (
            lambda: kjax.rotary_embedding(
                jnp.zeros((2,), jnp.int32), jnp.ones((3, 2, 8)), jnp.ones((3, 1, 8)), jnp.ones((9, 8))
            ),
            "q has 3 tokens",
        ),
        (
            lambda: kjax.rotary_embedding(
                jnp.zeros((3,), jnp.float32), jnp.ones((3, 2, 8)), jnp.ones((3, 1, 8)), jnp.ones((9, 8))
            ),
            "positions has dtype float32",
        ),
        (
            lambda: kjax.rope(
                jnp.zeros((3,), jnp.int32),
                jnp.ones((3, 2, 8)),
                jnp.ones((3, 1, 8)),
                jnp.ones((9, 8)),
                implementation="cuda",
            ),
            "unknown implementation 'cuda'",
        ),
    ],
)
def test_rotary_embedding_kiln_jax_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_rotary_embedding_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    q, k = jnp.ones((5, 4, 64), jnp.bfloat16), jnp.ones((5, 1, 64), jnp.bfloat16)
    positions, cache = jnp.arange(5, dtype=jnp.int32), kjax.rope_cos_sin_cache(64, 16)

    def lower(p, a, b, c):
        return rotary_embedding_pallas_tpu(p, a, b, c, interpret=False)

    lower_for_tpu(lower, positions, q, k, cache)
