"""paged_decode_attention's JAX backends (the Pallas TPU kernel, the Pallas GPU kernel, XLA) against
the spec's float64 reference through the torch-facing implementations, and the generated kiln.jax
entry."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.attention.paged_decode_attention.pallas_tpu import paged_decode_attention_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")

DECODE_GQA_3_CROSSES_PAGES = {
    "context_lens": [37, 1, 16, 70],  # 16: exactly one full page; 37, 70: partial last pages
    "num_heads": 9,
    "num_kv_heads": 3,
    "head_dim": 64,
    "block_size": 16,
}
DECODE_GQA_8_WINDOW_SOFTCAP = {
    "context_lens": [45, 33],
    "num_heads": 8,
    "num_kv_heads": 1,
    "head_dim": 80,
    "block_size": 8,
    "sliding_window": 20,
    "softcap": 5.0,
}
DECODE_MHA = {
    "context_lens": [23, 40],
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 128,
    "block_size": 16,
}


@pytest.mark.parametrize(
    "backend, dtype, shape",
    [
        ("pallas_tpu", torch.bfloat16, DECODE_GQA_3_CROSSES_PAGES),
        ("pallas_tpu", torch.float32, DECODE_GQA_8_WINDOW_SOFTCAP),
        ("pallas_tpu", torch.float16, DECODE_MHA),
        ("pallas_tpu", torch.float8_e4m3fn, DECODE_GQA_3_CROSSES_PAGES),  # fp16 queries, scaled fp8 cache
        ("xla", torch.bfloat16, DECODE_GQA_8_WINDOW_SOFTCAP),
        ("pallas_gpu", torch.bfloat16, DECODE_GQA_3_CROSSES_PAGES),  # group 3 padded to 4 rows
        ("pallas_gpu", torch.float32, DECODE_GQA_8_WINDOW_SOFTCAP),  # head_dim 80 padded to 128
        ("pallas_gpu", torch.float8_e4m3fn, DECODE_MHA),
    ],
)
def test_paged_decode_attention_with_shuffled_block_tables_matches_float64(backend, dtype, shape):
    # The spec's input maker hands out the cache blocks in a random permutation and fills unused
    # blocks with random data, so reading a wrong page cannot pass.
    case = run_case(
        get_op("paged_decode_attention"), backend, shape, dtype, CPU, seed=random.randrange(2**31)
    )
    assert case.passed, case


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu", "xla"])
def test_paged_decode_attention_never_lets_stale_nan_past_a_sequence_length_through(implementation):
    """Cache slots at or past a sequence's seq_len are never read: NaN there (the rest of sequence 0's
    page, batched with a longer sequence) must not reach the output."""
    key_cache = jnp.full((2, 16, 1, 64), jnp.nan, jnp.float32).at[0, :1].set(1.0).at[1].set(1.0)
    tables, seq_lens = jnp.array([[0], [1]], jnp.int32), jnp.array([1, 16], jnp.int32)
    out = kjax.paged_decode_attention(
        jnp.ones((2, 1, 64)), key_cache, key_cache, tables, seq_lens, implementation=implementation
    )
    assert bool(jnp.all(out == 1.0)), out[:, 0, :2]


def _decode(block_size, cache_dtype=jnp.float32):
    cache = jnp.ones((8, block_size, 1, 64), cache_dtype)
    q = jnp.ones((2, 4, 64), jnp.float16 if cache_dtype != jnp.float32 else jnp.float32)
    return kjax.paged_decode_attention(
        q, cache, cache, jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _decode(12), "block_size \\(dim 1\\) is 12, expected a power of two"),
        (lambda: _decode(16, jnp.float8_e4m3fn), "so k_scale .* is required"),
    ],
)
def test_paged_decode_attention_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_paged_decode_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    q, cache = jnp.ones((3, 8, 64), jnp.bfloat16), jnp.ones((10, 16, 2, 64), jnp.bfloat16)
    tables, seq_lens = jnp.zeros((3, 4), jnp.int32), jnp.array([5, 17, 40], jnp.int32)
    lower_for_tpu(
        lambda q, k, v, t, s: paged_decode_attention_pallas_tpu(q, k, v, t, s, interpret=False),
        q, cache, cache, tables, seq_lens,
    )  # fmt: skip
