"""jax.grad of kiln.jax.rms_norm / silu_and_mul / gelu_tanh_and_mul (custom_vjp, Pallas backward in
the TPU interpreter) against jax.grad of float64 (x64) references written in jax.numpy, with random
upstream gradients; a perturbed backward kernel must change the gradient (the kernel is what runs)."""

import random

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import kiln.jax as kj  # noqa: E402
import kiln.jax.autodiff as autodiff  # noqa: E402

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # one rounding of each gradient


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _rms_norm_64(x, w, r, offset):
    s = x if r is None else x + r
    y = s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + 1e-6) * (w + offset)
    return (y,) if r is None else (y, s)


def _grads(fn, args, upstream):
    """Gradients of sum(out_i * upstream_i) over every argument."""

    def loss(*a):
        outs = fn(*a)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(
            jnp.sum(o.astype(jnp.float32 if o.dtype != jnp.float64 else o.dtype) * u)
            for o, u in zip(outs, upstream, strict=True)
        )

    return jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def _check(kiln_fn, ref_fn, args, out_shapes, dtype):
    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    upstream = [rng.standard_normal(s) for s in out_shapes]
    got = _grads(kiln_fn, args, [jnp.asarray(u, jnp.float32) for u in upstream])
    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
        want = _grads(ref_fn, args64, [jnp.asarray(u) for u in upstream])
        errors = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) <= TOL[dtype], (errors, seed)
    return got


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("rows", "hidden", "offset", "residual"), [(5, 37, 0.0, False), (3, 130, 1.0, True)])
@pytest.mark.parametrize("implementation", ["pallas_tpu", "xla"])  # their backwards: Pallas, autodiff
def test_rms_norm_grad_matches_float64(rows, hidden, offset, residual, dtype, implementation):
    rng = np.random.default_rng(random.randrange(2**31))
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    w = jnp.asarray(rng.standard_normal(hidden) * 0.5 + 1 - offset, dtype)
    outs = [(rows, hidden)] * (2 if residual else 1)
    if residual:
        r = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
        _check(
            lambda x, w, r: kj.rms_norm(x, w, 1e-6, r, offset, implementation=implementation),
            lambda x, w, r: _rms_norm_64(x, w, r, offset),
            [x, w, r],
            outs,
            dtype,
        )
    else:
        _check(
            lambda x, w: kj.rms_norm(x, w, 1e-6, weight_offset=offset, implementation=implementation),
            lambda x, w: _rms_norm_64(x, w, None, offset),
            [x, w],
            outs,
            dtype,
        )


@pytest.mark.parametrize("implementation", ["pallas_tpu", "xla"])  # their backwards: Pallas, autodiff
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_grad_matches_float64(activation, dtype, implementation):
    rows, d = 7, 45
    rng = np.random.default_rng(random.randrange(2**31))
    x = jnp.asarray(rng.standard_normal((rows, 2 * d)) * 2, dtype)
    entry = kj.silu_and_mul if activation == "silu" else kj.gelu_tanh_and_mul

    def kiln_fn(x):
        return entry(x, implementation=implementation)

    def ref(x):
        a, b = x[:, :d], x[:, d:]
        act = jax.nn.silu(a) if activation == "silu" else jax.nn.gelu(a, approximate=True)
        return act * b

    _check(kiln_fn, ref, [x], [(rows, d)], dtype)


def test_grad_under_jit_and_the_backward_is_the_pallas_kernel_behind_pallas_tpu_only(monkeypatch):
    """Behind the Pallas TPU forward the backward is the Pallas kernel; behind xla (the CPU's default)
    XLA's autodiff, with the same gradients (the TPU kernel ran interpreted: 24 ms against 0.5 ms)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32)
    # a random upstream gradient: sum(rms_norm(x) ** 2) would be nearly constant in x, its gradient
    # only cancellation noise
    upstream = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)

    def loss_with(implementation):
        return lambda x, w: jnp.sum(kj.rms_norm(x, w, 1e-6, implementation=implementation) * upstream)

    right = jax.jit(jax.grad(loss_with("pallas_tpu"), argnums=(0, 1)))(x, w)
    by_xla = jax.jit(jax.grad(loss_with(None), argnums=(0, 1)))(x, w)
    for a, b in zip(by_xla, right, strict=True):
        assert _rel(a, b) <= TOL["float32"], _rel(a, b)
    real = autodiff.rms_norm_backward_pallas
    monkeypatch.setattr(autodiff, "rms_norm_backward_pallas", lambda *a: tuple(g * 2 for g in real(*a)))
    doubled = jax.grad(loss_with("pallas_tpu"), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(doubled[0]), 2 * np.asarray(right[0]), rtol=1e-6)
    unchanged = jax.grad(loss_with("xla"), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(unchanged[0]), np.asarray(by_xla[0]), rtol=1e-6)
