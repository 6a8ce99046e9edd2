"""FlashAttention (TPU and GPU Pallas kernels, XLA) and paged decode attention against the torch
specs' float64 references, through the registered implementations (varlen and paged adapters)."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.attention.pallas import flash_attention_pallas_tpu  # noqa: E402
from kiln.ops.attention.pallas_paged import paged_decode_attention_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")

FLASH_GQA_4_VARLEN_LSE = {
    "seqlens_q": [37, 5, 1],
    "seqlens_k": [37, 21, 19],  # bottom-right causal: short query runs see long contexts
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 64,
    "return_lse": True,
}
FLASH_GQA_8_WINDOW_SOFTCAP = {
    "seqlens_q": [29],
    "seqlens_k": [29],
    "num_heads": 8,
    "num_kv_heads": 1,
    "head_dim": 80,
    "sliding_window": 7,
    "softcap": 5.0,
}
FLASH_MHA_NON_CAUSAL = {
    "seqlens_q": [18, 33],
    "seqlens_k": [40, 33],
    "num_heads": 3,
    "num_kv_heads": 3,
    "head_dim": 96,
    "causal": False,
    "return_lse": True,
}
# 150 queries: two query blocks and two key blocks of 128 on the TPU kernel.
FLASH_MULTI_BLOCK = {
    "seqlens_q": [150],
    "seqlens_k": [150],
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 64,
}


@pytest.mark.parametrize(
    "backend, dtype, shape",
    [
        ("pallas_tpu", torch.bfloat16, FLASH_GQA_4_VARLEN_LSE),
        ("pallas_tpu", torch.float32, FLASH_GQA_8_WINDOW_SOFTCAP),
        ("pallas_tpu", torch.float16, FLASH_MHA_NON_CAUSAL),
        ("pallas_tpu", torch.bfloat16, FLASH_MULTI_BLOCK),
        ("pallas_gpu", torch.bfloat16, FLASH_GQA_4_VARLEN_LSE),
        ("pallas_gpu", torch.float32, FLASH_GQA_8_WINDOW_SOFTCAP),
        ("xla", torch.bfloat16, FLASH_GQA_8_WINDOW_SOFTCAP),
    ],
    ids=lambda v: (
        v.get("num_kv_heads") and f"H{v['num_heads']}_Hkv{v['num_kv_heads']}"
        if isinstance(v, dict)
        else str(v)
    ),
)
def test_flash_attention_matches_float64_reference(backend, dtype, shape):
    case = run_case(get_op("flash_attention"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


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
    ],
)
def test_paged_decode_attention_with_shuffled_block_tables_matches_float64(backend, dtype, shape):
    # The spec's input maker hands out the cache blocks in a random permutation and fills unused
    # blocks with random data, so reading a wrong page cannot pass.
    case = run_case(
        get_op("paged_decode_attention"), backend, shape, dtype, CPU, seed=random.randrange(2**31)
    )
    assert case.passed, case


def test_flash_attention_tpu_interpreter_finds_no_races_on_two_cores():
    interpret_state = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    q = jax.random.normal(jax.random.key(0), (1, 20, 4, 64), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(1), (1, 24, 1, 64), jnp.bfloat16)
    with kjax.tpu_interpreter(detect_races=True, num_cores_or_threads=2):
        out = kjax.flash_attention(q, k, k, implementation="pallas_tpu")
        out.block_until_ready()
    races = getattr(interpret_state, "races", None)
    if races is None:
        pytest.skip("this JAX version keeps its race-detector state elsewhere")
    assert races.races_found is False
    ref = kjax.flash_attention(q, k, k, implementation="xla")
    assert (
        float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
        < 1e-2
    )


def _flash(q_shape, kv_shape, **kwargs):
    return kjax.flash_attention(jnp.ones(q_shape), jnp.ones(kv_shape), jnp.ones(kv_shape), **kwargs)


def _decode(block_size, cache_dtype=jnp.float32):
    cache = jnp.ones((8, block_size, 1, 64), cache_dtype)
    q = jnp.ones((2, 4, 64), jnp.float16 if cache_dtype != jnp.float32 else jnp.float32)
    return kjax.paged_decode_attention(
        q, cache, cache, jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _flash((1, 4, 6, 64), (1, 4, 4, 64)), "multiple of num_kv_heads"),
        (lambda: _flash((4, 6, 64), (4, 6, 64)), "q must have 4 dims"),
        (lambda: _flash((1, 4, 2, 64), (1, 4, 2, 64), sliding_window=0), "sliding_window must be positive"),
        (lambda: _decode(12), "block_size 12 must be a power of two"),
        (lambda: _decode(16, jnp.float8_e4m3fn), "needs k_scale and v_scale"),
    ],
)
def test_attention_ops_reject_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_attention_tpu_kernels_lower_to_mosaic(lower_for_tpu):
    q, k = jnp.ones((2, 37, 4, 64), jnp.bfloat16), jnp.ones((2, 45, 1, 64), jnp.bfloat16)
    lens = jnp.array([37, 5], jnp.int32)
    lower_for_tpu(
        lambda q, k, v, a, b: flash_attention_pallas_tpu(q, k, v, a, b, True, None, 7, 5.0, interpret=False),
        q, k, k, lens, lens,
    )  # fmt: skip
    q, cache = jnp.ones((3, 8, 64), jnp.bfloat16), jnp.ones((10, 16, 2, 64), jnp.bfloat16)
    tables, seq_lens = jnp.zeros((3, 4), jnp.int32), jnp.array([5, 17, 40], jnp.int32)
    lower_for_tpu(
        lambda q, k, v, t, s: paged_decode_attention_pallas_tpu(q, k, v, t, s, interpret=False),
        q, cache, cache, tables, seq_lens,
    )  # fmt: skip
