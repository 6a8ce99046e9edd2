"""kiln.jax's rms_norm and gated-activation backward kernels (kiln.jax.backward_pallas) lower through
Mosaic for the TPU without one (block shapes and ops Mosaic rejects fail here); the FlashAttention
backward's lowering is checked in test_flash_attention_vjp.py."""

import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from kiln.jax.backward_pallas import gated_backward_pallas, rms_norm_backward_pallas  # noqa: E402


@pytest.mark.parametrize(("dtype", "hidden"), [("bfloat16", 512), ("float32", 130)])
def test_rms_norm_backward_lowers_to_mosaic(lower_for_tpu, dtype, hidden):
    x, w = jnp.ones((13, hidden), dtype), jnp.ones((hidden,), dtype)
    lower_for_tpu(lambda x, w, g: rms_norm_backward_pallas(x, w, g, 1e-6, 1.0, interpret=False), x, w, x)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_backward_lowers_to_mosaic(lower_for_tpu, activation):
    x, g = jnp.ones((13, 2 * 300), jnp.bfloat16), jnp.ones((13, 300), jnp.bfloat16)
    lower_for_tpu(lambda x, g: gated_backward_pallas(x, g, activation, interpret=False), x, g)
