"""jax.grad of kiln.jax.flash_attention (custom_vjp, Pallas TPU backward kernels in the TPU interpreter,
recomputing from the saved LSE) against jax.vjp of plain jax.numpy attention in float64 (x64), with
random upstream gradients on out and lse; the backward kernels over several blocks with padded rows;
the kernel is what runs; both kernels lower through Mosaic for the TPU."""

import random

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import kiln.jax as kj  # noqa: E402
import kiln.jax.attention_autodiff as attention_autodiff  # noqa: E402
from kiln.ops.attention.flash_attention_backward.pallas_tpu import (  # noqa: E402
    flash_attention_backward_padded_pallas_tpu,
)

# The backward op's tolerances (kiln.ops.attention.flash_attention_backward.spec): float32 summation
# order; halves round the forward's out (reaching dS through delta) and P / dS for the matmuls.
TOL = {"float32": 1e-5, "bfloat16": 1.6e-2}


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _inputs(rng, dtype, batch, seq_q, seq_k, heads, kv_heads, head_dim=64):
    q = jnp.asarray(rng.standard_normal((batch, seq_q, heads, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((batch, seq_k, kv_heads, head_dim)), dtype) for _ in "kv")
    return q, k, v


def _attention_64(q, k, v, q_lens, kv_lens, causal, window, softcap):
    """Plain float64 attention on a padded batch: (out [B, Sq, H, D], lse [B, H, Sq]); bottom-right
    causal, query i at key position i + kv_len - q_len, window keeps position - j < W."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    position = jnp.arange(q.shape[1])[None, :, None] + (kv_lens - q_lens)[:, None, None]
    cols = jnp.arange(k.shape[1])[None, None, :]
    visible = cols < kv_lens[:, None, None]
    if causal:
        visible &= cols <= position
    if window is not None:
        visible &= position - cols < window
    visible = visible[:, None]  # [B, 1, Sq, Sk]
    seen = visible.any(axis=-1)
    s = jnp.where(visible, s, -jnp.inf)
    lse = jnp.where(seen, jax.nn.logsumexp(jnp.where(seen[..., None], s, 0.0), axis=-1), -jnp.inf)
    p = jnp.where(visible, jnp.exp(s - jnp.where(seen, lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v), lse


def _reference_grads(q, k, v, q_lens, kv_lens, grad_out, grad_lse, causal, window, softcap):
    """(dq, dk, dv) float64 by jax.vjp of the float64 attention on the (rounded) inputs."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v)]
        lens = [jnp.asarray(np.asarray(n), jnp.int64) for n in (q_lens, kv_lens)]

        def forward(q, k, v):
            return _attention_64(q, k, v, *lens, causal, window, softcap)

        (_, lse), vjp = jax.vjp(jax.jit(forward), *args)
        assert lse.dtype == jnp.float64
        grad_lse = jnp.where(jnp.isfinite(lse), jnp.asarray(grad_lse, jnp.float64), 0.0)
        return [np.asarray(g) for g in vjp((jnp.asarray(grad_out, jnp.float64), grad_lse))]


CASES = [  # dtype, forward kernel (its backward: the Pallas TPU pair, or XLA's autodiff), causal, window,
    # softcap, (batch, Sq, Sk, H, Hkv)
    ("float32", "xla", True, 7, 5.0, (1, 37, 45, 4, 2)),  # GQA, odd lengths, more keys, window, soft-cap
    ("float32", "pallas_tpu", True, 7, 5.0, (1, 37, 45, 4, 2)),
    ("bfloat16", "pallas_tpu", False, None, None, (2, 21, 29, 2, 2)),  # the Pallas forward's saved LSE
]


@pytest.mark.parametrize(("dtype", "forward", "causal", "window", "softcap", "dims"), CASES)
def test_flash_attention_grad_matches_float64(dtype, forward, causal, window, softcap, dims):
    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    batch, seq_q, seq_k, heads, kv_heads = dims
    q, k, v = _inputs(rng, dtype, batch, seq_q, seq_k, heads, kv_heads)
    grad_out = rng.standard_normal(q.shape)
    grad_lse = rng.standard_normal((batch, heads, seq_q))

    def loss(q, k, v):
        out, lse = kj.flash_attention(
            q, k, v, causal, None, forward, sliding_window=window, softcap=softcap, return_lse=True
        )
        return jnp.sum(out.astype(jnp.float32) * grad_out) + jnp.sum(lse * grad_lse)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    lens_q, lens_k = jnp.full((batch,), seq_q, jnp.int32), jnp.full((batch,), seq_k, jnp.int32)
    want = _reference_grads(q, k, v, lens_q, lens_k, grad_out, grad_lse, causal, window, softcap)
    assert [g.dtype for g in got] == [q.dtype] * 3
    errors = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) <= TOL[dtype], (errors, seed)


def test_backward_kernels_over_several_blocks_with_padded_rows():
    """16-row blocks (3 query x 3 key blocks; the sliding window skips some), per-row lengths: row 1
    has 20 queries over 7 keys, so its first 13 queries see no key; rows past a length must get
    exactly zero gradients."""
    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    causal, window = True, 9
    q, k, v = _inputs(rng, "float32", 2, 37, 45, 2, 1)
    q_lens, kv_lens = jnp.array([37, 20], jnp.int32), jnp.array([45, 7], jnp.int32)
    out, lse = kj.flash_attention(
        q, k, v, causal, None, "xla", sliding_window=window, q_lens=q_lens, kv_lens=kv_lens, return_lse=True
    )
    valid_q = (np.arange(37)[None, :] < np.asarray(q_lens)[:, None])[:, :, None, None]
    grad_out = rng.standard_normal(q.shape) * valid_q  # outputs past q_len are not part of the result
    grad_lse = rng.standard_normal(lse.shape) * valid_q[:, None, :, 0, 0]
    got = flash_attention_backward_padded_pallas_tpu(
        jnp.asarray(grad_out, q.dtype), q, k, v, out, lse, q_lens, kv_lens, causal, None, window, None,
        jnp.asarray(grad_lse, jnp.float32), block_q=16, block_k=16,
    )  # fmt: skip
    want = _reference_grads(q, k, v, q_lens, kv_lens, grad_out, grad_lse, causal, window, None)
    errors = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) <= TOL["float32"], (errors, seed)
    assert not np.asarray(got[0][1, 20:]).any()  # queries past q_len
    assert not np.asarray(got[1][1, 7:]).any() and not np.asarray(got[2][1, 7:]).any()  # keys past kv_len


def test_the_backward_is_the_pallas_kernel_behind_the_pallas_tpu_forward_only(monkeypatch):
    """Behind the Pallas TPU forward the backward is its Pallas kernel pair; behind the others XLA's
    autodiff of the XLA forward, with the same gradients (the TPU kernels ran in the TPU interpreter
    behind every forward off a TPU: 0.19 s against 1.7 ms for a [1, 256, 4, 64] backward here)."""
    q, k, v = _inputs(np.random.default_rng(0), "float32", 1, 9, 9, 2, 1)

    def grads(implementation):
        def loss(q, k, v):
            return jnp.sum(kj.flash_attention(q, k, v, implementation=implementation) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    right, by_xla = grads("pallas_tpu"), grads("xla")
    assert all(bool(jnp.isfinite(g).all()) and float(jnp.abs(g).max()) > 0 for g in right)
    for x, r in zip(by_xla, right, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(r), rtol=1e-4, atol=1e-5)
    real = attention_autodiff.flash_attention_backward_padded_pallas_tpu
    monkeypatch.setattr(
        attention_autodiff,
        "flash_attention_backward_padded_pallas_tpu",
        lambda *a: tuple(g * 2 for g in real(*a)),
    )
    for d, r in zip(grads("pallas_tpu"), right, strict=True):
        np.testing.assert_allclose(np.asarray(d), 2 * np.asarray(r), rtol=1e-6)
    for x, r in zip(grads("xla"), by_xla, strict=True):  # the Pallas backward is not called
        np.testing.assert_array_equal(np.asarray(x), np.asarray(r))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_flash_attention_backward_tpu_kernels_lower_to_mosaic(lower_for_tpu, dtype):
    q, k = jnp.ones((2, 37, 4, 64), dtype), jnp.ones((2, 45, 1, 64), dtype)
    lse, lens = jnp.zeros((2, 4, 37), jnp.float32), jnp.array([37, 5], jnp.int32)

    def backward(dout, q, k, v, out, lse, q_lens, kv_lens, grad_lse):
        return flash_attention_backward_padded_pallas_tpu(
            dout,
            q,
            k,
            v,
            out,
            lse,
            q_lens,
            kv_lens,
            True,
            None,
            7,
            5.0,
            grad_lse,
            block_q=16,
            interpret=False,
        )

    text = lower_for_tpu(backward, q, q, k, k, q, lse, lens, lens, lse)
    assert text.count("tpu_custom_call") == 2  # the dK/dV and the dQ kernels
