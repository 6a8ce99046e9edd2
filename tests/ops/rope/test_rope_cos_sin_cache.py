"""rope_cos_sin_cache (kiln/ops/rope/cache.py): the (scaled) frequencies against transformers, the
table against float64 angles, argument errors; and kiln.jax's copy of the table."""

import numpy as np
import pytest
import torch

import kiln.ops
from kiln.ops.rope.cache import rope_inv_freq
from kiln.verify import assert_close
from tests.ops.rope.hf_rope import SCALINGS, hf_llama_config


@pytest.mark.parametrize("name", SCALINGS)
def test_rope_inv_freq_matches_transformers_rope_init_functions(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = hf_llama_config(128, SCALINGS[name], 500000.0)
    init = (
        LlamaRotaryEmbedding.compute_default_rope_parameters
        if name == "default"
        else ROPE_INIT_FUNCTIONS[name]
    )
    hf_inv_freq, attention_factor = init(config, device="cpu")
    assert attention_factor == 1.0
    ours = rope_inv_freq(128, 500000.0, SCALINGS[name])
    assert ours.shape == hf_inv_freq.shape
    # HF computes in float32: agreement to a few float32 ulps.
    assert_close(ours, hf_inv_freq.double(), 1e-6)
    if name == "llama3":  # all three bands (kept, blended, divided) occur for Llama-3's parameters
        ratio = hf_inv_freq.double() / rope_inv_freq(128, 500000.0, None)
        assert bool((ratio > 0.99).any() and (ratio < 0.13).any() and ((ratio > 0.13) & (ratio < 0.99)).any())


@pytest.mark.parametrize("name", SCALINGS)
def test_rope_cos_sin_cache_is_cos_then_sin_of_float64_angles(name):
    # The frequencies are checked against transformers above; here the table built from them.
    inv_freq = rope_inv_freq(64, 10000.0, SCALINGS[name])
    cache = kiln.ops.rope_cos_sin_cache(64, 131072, 10000.0, SCALINGS[name])
    assert cache.shape == (131072, 64) and cache.dtype == torch.float32
    positions = torch.tensor([0, 1, 17, 8191, 65537, 131071])
    angles = positions.double()[:, None] * inv_freq[None, :]
    # Angles in float64: even at position 131071 the table is good to float32 rounding (a float32
    # product p * f would be off by up to ~1e-2 radians there).
    assert_close(cache[positions, :32], angles.cos(), 1e-6)
    assert_close(cache[positions, 32:], angles.sin(), 1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rotary_dim": 7, "max_position": 10}, "rotary_dim must be a positive even int"),
        ({"rotary_dim": 8, "max_position": 0}, "max_position must be a positive int"),
        (
            {"rotary_dim": 8, "max_position": 10, "scaling": {"rope_type": "yarn"}},
            "rope_type 'yarn' is not supported",
        ),
        ({"rotary_dim": 8, "max_position": 10, "scaling": {"rope_type": "linear"}}, "needs key 'factor'"),
        ({"rotary_dim": 8, "max_position": 10, "dtype": torch.int32}, "not a float dtype"),
    ],
)
def test_rope_cos_sin_cache_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.rope_cos_sin_cache(**kwargs)


def test_kiln_jax_rope_cos_sin_cache_is_cos_then_sin_of_float64_angles_as_a_jax_array():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import kiln.jax as kjax

    table = kjax.rope_cos_sin_cache(64, 4096)  # float32, base 10000, no scaling
    assert table.shape == (4096, 64) and table.dtype == jnp.float32
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, 64, 2, dtype=np.float64) / 64))
    angles = np.arange(4096, dtype=np.float64)[:, None] * inv_freq[None, :]
    expected = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)
    np.testing.assert_allclose(np.asarray(table, np.float64), expected, rtol=0, atol=1e-7)
    # With a scaling and a dtype: the kiln.ops table, as a jax array.
    scaled = kjax.rope_cos_sin_cache(64, 4096, 500000.0, jnp.bfloat16, SCALINGS["llama3"])
    want = kiln.ops.rope_cos_sin_cache(64, 4096, 500000.0, SCALINGS["llama3"], torch.bfloat16)
    assert scaled.dtype == jnp.bfloat16
    assert torch.equal(torch.from_numpy(np.array(scaled.astype(jnp.float32))), want.float())
