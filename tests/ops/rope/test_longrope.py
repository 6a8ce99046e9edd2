"""LongRoPE (Phi-3's rope scaling) in rope_cos_sin_cache: frequencies and attention factor against
transformers' `_compute_longrope_parameters`, the table against float64 angles of transformers'
frequencies and against Phi3RotaryEmbedding's cos/sin, and the choice of short / long factors by
position (kiln.ops.rope.longrope's docstring says why)."""

import math
import warnings

import pytest
import torch

import kiln.ops
from kiln.ops.rope.longrope import longrope_attention_factor, longrope_inv_freqs
from kiln.verify import assert_close

transformers = pytest.importorskip("transformers")


def _scaling(pairs, original, seed=0, **extra):
    generator = torch.Generator().manual_seed(seed)
    short = (1.0 + 0.5 * torch.rand(pairs, generator=generator, dtype=torch.float64)).tolist()
    long = (1.0 + 30.0 * torch.rand(pairs, generator=generator, dtype=torch.float64)).tolist()
    return {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": original,
        **extra,
    }


def _hf_config(head_dim, max_position, scaling, base):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Phi3Config(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            max_position_embeddings=max_position,
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
            rope_parameters={"rope_theta": base, **scaling},
            pad_token_id=0,
        )


def _hf_longrope(config, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)


# Phi-3.5-mini's shapes (head_dim 96, 4k pre-training context, 128k positions); a small odd one.
SHAPES = {"phi35_mini": (96, 4096, 131072, 10000.0), "small": (16, 24, 80, 500.0)}


@pytest.mark.parametrize("shape", SHAPES)
def test_longrope_frequencies_and_attention_factor_match_transformers(shape):
    head_dim, original, max_position, base = SHAPES[shape]
    scaling = _scaling(head_dim // 2, original)
    config = _hf_config(head_dim, max_position, scaling, base)
    hf_short, hf_factor = _hf_longrope(config, seq_len=None)
    hf_long, hf_factor_long = _hf_longrope(config, seq_len=original + 1)
    short, long = longrope_inv_freqs(head_dim, base, scaling)
    # transformers computes the frequencies in float32: a few float32 ulps apart.
    assert_close(short, hf_short.double(), 1e-6)
    assert_close(long, hf_long.double(), 1e-6)
    ours = longrope_attention_factor(scaling, max_position)
    assert ours == pytest.approx(hf_factor, rel=1e-12) and hf_factor == hf_factor_long
    assert ours == pytest.approx(math.sqrt(1 + math.log(max_position / original) / math.log(original)))


@pytest.mark.parametrize("shape", SHAPES)
def test_longrope_table_uses_short_factors_below_the_original_length_and_long_ones_after(shape):
    head_dim, original, max_position, base = SHAPES[shape]
    scaling = _scaling(head_dim // 2, original, seed=1)
    _, factor = _hf_longrope(_hf_config(head_dim, max_position, scaling, base), seq_len=None)
    # The frequencies are checked against transformers above; here the table built from them (angles
    # in float64: transformers' float32 angles are off by ~1e-2 radians at position 131071).
    short, long = longrope_inv_freqs(head_dim, base, scaling)
    table = kiln.ops.rope_cos_sin_cache(head_dim, max_position, base, scaling, torch.float32)
    assert table.shape == (max_position, head_dim) and table.dtype == torch.float32
    positions = torch.tensor(sorted({0, 1, 7, original - 1, original, original + 5, max_position - 1}))
    inv_freq = torch.where((positions < original)[:, None], short, long)
    angles = positions.double()[:, None] * inv_freq
    r = head_dim // 2
    assert_close(table[positions, :r], factor * angles.cos(), 1e-6)
    assert_close(table[positions, r:], factor * angles.sin(), 1e-6)


def test_longrope_table_matches_phi3_rotary_embedding_for_sequences_up_to_the_original_length():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    head_dim, original, max_position, base = 16, 24, 80, 500.0
    scaling = _scaling(head_dim // 2, original, seed=2)
    rotary = Phi3RotaryEmbedding(_hf_config(head_dim, max_position, scaling, base))
    table = kiln.ops.rope_cos_sin_cache(head_dim, max_position, base, scaling, torch.float64)
    r = head_dim // 2
    x = torch.zeros(1, dtype=torch.float32)
    # A sequence of `original` tokens: transformers uses the short factors, as Kiln's rows < original.
    cos, sin = rotary(x, torch.arange(original)[None])
    assert_close(table[:original, :r], cos[0, :, :r].double(), 1e-5)
    assert_close(table[:original, r:], sin[0, :, :r].double(), 1e-5)
    # A longer sequence: transformers switches every position to the long factors; Kiln's rows from
    # `original` on are the same, its rows below `original` stay short (a paged cache keeps old keys).
    cos, sin = rotary(x, torch.arange(max_position)[None])
    assert_close(table[original:, :r], cos[0, original:, :r].double(), 1e-5)
    assert_close(table[original:, r:], sin[0, original:, :r].double(), 1e-5)
    assert (table[1:original, :r] - cos[0, 1:original, :r].double()).abs().max() > 1e-2


def test_su_alias_explicit_factor_and_attention_factor():
    base_scaling = _scaling(4, 16)
    su = dict(base_scaling, rope_type="su")
    assert torch.equal(
        kiln.ops.rope_cos_sin_cache(8, 40, 100.0, su), kiln.ops.rope_cos_sin_cache(8, 40, 100.0, base_scaling)
    )
    # factor given: it, not max_position / original, sets the attention factor
    assert longrope_attention_factor(dict(base_scaling, factor=32.0), 40) == pytest.approx(
        math.sqrt(1 + math.log(32.0) / math.log(16))
    )
    assert longrope_attention_factor(dict(base_scaling, factor=1.0), 40) == 1.0
    explicit = dict(base_scaling, attention_factor=1.5)
    plain = dict(base_scaling, attention_factor=1.0)
    assert_close(
        kiln.ops.rope_cos_sin_cache(8, 40, 100.0, explicit, torch.float64),
        1.5 * kiln.ops.rope_cos_sin_cache(8, 40, 100.0, plain, torch.float64),
        1e-15,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"short_factor": None}, "needs key 'short_factor'"),
        ({"long_factor": [1.0, 2.0]}, "long_factor has 2 entries, expected rotary_dim // 2 = 4"),
        ({"short_factor": [1.0, 0.0, 1.0, 1.0]}, "finite and positive"),
        ({"original_max_position_embeddings": None}, "original_max_position_embeddings"),
        ({"attention_factor": -1.0}, "attention_factor must be positive"),
    ],
)
def test_bad_longrope_scaling_is_rejected_with_the_key(change, message):
    scaling = {k: v for k, v in {**_scaling(4, 16), **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        kiln.ops.rope_cos_sin_cache(8, 40, 100.0, scaling)


def test_rope_inv_freq_refuses_longrope_whose_frequencies_depend_on_position():
    from kiln.ops.rope.cache import rope_inv_freq

    with pytest.raises(ValueError, match="depend on the position"):
        rope_inv_freq(8, 100.0, _scaling(4, 16))
