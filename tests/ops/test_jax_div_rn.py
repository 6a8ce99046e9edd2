"""kiln.ops.jax_div_rn.div_rn: float32 quotients rounded once, as numpy / torch divide, where XLA's
simplifier would multiply by the divisor's reciprocal (a broadcast or a constant divisor)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from kiln.ops.jax_div_rn import div_rn  # noqa: E402


def test_quotients_by_a_broadcast_and_a_constant_divisor_are_the_ieee_ones():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((512, 96)).astype(np.float32)
    y = (rng.random((512, 1)) + 0.01).astype(np.float32)
    assert np.array_equal(np.asarray(jax.jit(div_rn)(x, y)), x / y)
    assert np.array_equal(np.asarray(jax.jit(lambda v: div_rn(v, 448.0))(x)), x / np.float32(448.0))


def test_inside_an_interpreted_pallas_kernel():
    from jax.experimental import pallas as pl

    rng = np.random.default_rng(8)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    y = (rng.random((16, 1)) + 0.01).astype(np.float32)

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = div_rn(x_ref[...], y_ref[...])

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, np.float32), interpret=True)(x, y)
    assert np.array_equal(np.asarray(out), x / y)
