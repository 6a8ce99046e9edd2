"""paged_prefill_attention's JAX backends (the Pallas TPU kernel in the TPU interpreter, the Pallas GPU
kernel in the Pallas interpreter, XLA) against the spec's float64 reference through the torch-facing
implementations, the generated kiln.jax entry, and the kernels' Mosaic / Triton lowerings; an fp8
cache's exact positions included."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.attention.paged_prefill_attention.pallas_gpu import paged_prefill_attention_pallas_gpu  # noqa: E402
from kiln.ops.attention.paged_prefill_attention.pallas_tpu import paged_prefill_attention_pallas_tpu  # noqa: E402
from kiln.ops.attention.paged_prefill_attention.spec import (  # noqa: E402
    EXACT_MIXED_RING_WRAPS,
    EXACT_WITH_SLIDING_WINDOW,
)
from kiln.ops.jax_bridge import to_jax  # noqa: E402
from kiln.verify import run_case  # noqa: E402
from tests.ops.attention.paged_cases import jax_jit_against_torch_cpu, tightest_exact_ring_error  # noqa: E402

CPU = torch.device("cpu")

MIXED_GQA_4 = {  # a fresh prefill, a chunk after a prefix hit, two decodes (q_len 1)
    "query_lens": [21, 9, 1, 1],
    "context_lens": [21, 40, 1, 35],
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 64,
    "block_size": 16,
}
WINDOW_SOFTCAP_GQA_8 = {
    "query_lens": [19],
    "context_lens": [50],
    "num_heads": 8,
    "num_kv_heads": 1,
    "head_dim": 80,
    "block_size": 8,
    "sliding_window": 13,
    "softcap": 5.0,
}
MHA_3 = {"query_lens": [7, 16], "context_lens": [7, 33], "num_heads": 3, "num_kv_heads": 3, "head_dim": 128,
         "block_size": 16}  # fmt: skip
# fp8 caches with exact positions: the spec's two fuzz shapes (imported) and one with W = 0. The exact
# caches are drawn independently of the fp8 cache, rings one entry wider than the window needs.
EXACT_FIRST_BLOCK_ONLY = {"query_lens": [5, 12], "context_lens": [5, 30], "num_heads": 2, "num_kv_heads": 2,
                          "head_dim": 64, "block_size": 8, "exact_window": 0}  # fmt: skip

EXACT_TIGHT_RING = {  # the spec's input maker gives R one column more than the contract's least
    "query_lens": [10, 1, 30],
    "context_lens": [50, 37, 70],
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "block_size": 16,
    "exact_window": 20,
}


@pytest.mark.parametrize(
    "backend, dtype, shape",
    [
        ("pallas_tpu", torch.float32, MIXED_GQA_4),
        ("pallas_tpu", torch.bfloat16, WINDOW_SOFTCAP_GQA_8),
        ("pallas_tpu", torch.float16, MHA_3),
        ("pallas_tpu", torch.float8_e4m3fn, MIXED_GQA_4),  # fp16 queries, scaled fp8 cache
        ("xla", torch.float32, WINDOW_SOFTCAP_GQA_8),
        ("xla", torch.bfloat16, MIXED_GQA_4),
        ("xla", torch.float8_e4m3fn, MHA_3),
        ("pallas_gpu", torch.float32, MIXED_GQA_4),  # pages of 16: tl.dot
        ("pallas_gpu", torch.bfloat16, WINDOW_SOFTCAP_GQA_8),  # pages of 8: broadcast sums; D 80 -> 128
        ("pallas_gpu", torch.float16, MHA_3),  # group 1: 16 queries per tile
        ("pallas_gpu", torch.float8_e4m3fn, MIXED_GQA_4),
    ],
)
def test_paged_prefill_attention_with_shuffled_block_tables_matches_float64(backend, dtype, shape):
    # Shuffled pages and random data in unused blocks: reading a wrong page cannot pass.
    op = get_op("paged_prefill_attention")
    case = run_case(op, backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


def test_exact_shapes_are_the_specs():
    spec_shapes = get_op("paged_prefill_attention").fuzz_shapes(random.Random(0))[:-1]
    assert EXACT_MIXED_RING_WRAPS in spec_shapes and EXACT_WITH_SLIDING_WINDOW in spec_shapes


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize(
    "shape",
    [EXACT_MIXED_RING_WRAPS, EXACT_WITH_SLIDING_WINDOW, EXACT_FIRST_BLOCK_ONLY],
    ids=["mixed_ring_wraps", "sliding_window", "first_block_only"],
)
def test_paged_prefill_attention_reads_exact_positions_of_an_fp8_cache_matches_float64(backend, shape):
    op = get_op("paged_prefill_attention")
    case = run_case(op, backend, shape, torch.float8_e4m3fn, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize(
    "kernel, shape, dtype",
    [(paged_prefill_attention_pallas_tpu, MIXED_GQA_4, torch.float32),
     (paged_prefill_attention_pallas_gpu, MIXED_GQA_4, torch.float32),
     (paged_prefill_attention_pallas_gpu, WINDOW_SOFTCAP_GQA_8, torch.float32),
     # each query block's own page range holds its own mix of exact and fp8 pages
     (paged_prefill_attention_pallas_tpu, EXACT_WITH_SLIDING_WINDOW, torch.float8_e4m3fn),
     (paged_prefill_attention_pallas_gpu, EXACT_WITH_SLIDING_WINDOW, torch.float8_e4m3fn)],
)  # fmt: skip
def test_paged_prefill_pallas_several_query_blocks_match_xla(kernel, shape, dtype):
    # block_q 8 over 21 (19) queries: three query blocks, the last partial, each with its own page range.
    op = get_op("paged_prefill_attention")
    inputs = op.make_inputs(shape, dtype, CPU, torch.Generator().manual_seed(random.randrange(2**31)))
    args = {k: to_jax(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    got = kernel(**args, block_q=8).astype(jnp.float32)
    want = kjax.paged_prefill_attention(**args, implementation="xla").astype(jnp.float32)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < tolerance


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
def test_paged_prefill_attention_tightest_exact_ring_matches_float64(backend):
    """R = ceil(W / block_size) ring columns, the fewest the contract allows: a window over R + 1
    pages (seq_len 50: positions 30..49 on pages 1, 2, 3) has its first and last pages in one ring
    block, at different offsets."""
    error = tightest_exact_ring_error("paged_prefill_attention", backend, EXACT_TIGHT_RING)  # R = 2
    assert error < get_op("paged_prefill_attention").tolerance[torch.float8_e4m3fn]


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu", "xla"])
def test_kiln_jax_paged_prefill_attention_with_exact_positions_under_jit_matches_torch_cpu(implementation):
    error, static, arrays = jax_jit_against_torch_cpu(
        "paged_prefill_attention", implementation, shape=EXACT_MIXED_RING_WRAPS
    )
    assert static["exact_window"] == 20 and "exact_block_tables" in arrays
    assert error < 2e-3


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu", "xla"])
def test_paged_prefill_attention_never_lets_stale_nan_past_a_sequence_length_through(implementation):
    """Cache slots at or past seq_len are never read: NaN in the rest of the last page must not leak."""
    cache = jnp.full((2, 8, 1, 64), jnp.nan, jnp.float32).at[0].set(1.0).at[1, :3].set(1.0)
    tables, seq_lens = jnp.array([[0, 1]], jnp.int32), jnp.array([11], jnp.int32)
    out = kjax.paged_prefill_attention(
        jnp.ones((4, 2, 64)), cache, cache, tables, jnp.array([0, 4], jnp.int32), seq_lens, 4,
        implementation=implementation,
    )  # fmt: skip
    # an average of ones: 1 to a rounding of the softmax weights' sum (XLA on an AVX2 CPU: 1.0000001)
    assert not bool(jnp.any(jnp.isnan(out))) and float(jnp.max(jnp.abs(out - 1.0))) <= 1e-6, out[:, 0, :2]


def test_paged_prefill_attention_kiln_jax_rejects_bad_input():
    cache = jnp.ones((4, 16, 1, 64))
    with pytest.raises(ValueError, match="max_seqlen_q must be a non-negative int"):
        kjax.paged_prefill_attention(
            jnp.ones((3, 2, 64)), cache, cache, jnp.zeros((1, 2), jnp.int32), jnp.array([0, 3], jnp.int32),
            jnp.array([5], jnp.int32), -1,
        )  # fmt: skip


def _prefill_exact(cache_dtype=jnp.float8_e4m3fn, **overrides):
    """A prefill with exact positions through kiln.jax, one argument replaced."""
    cache, exact = jnp.ones((4, 16, 1, 64), cache_dtype), jnp.ones((3, 16, 1, 64), jnp.float16)
    scales = jnp.ones((1,), jnp.float32) if cache_dtype == jnp.float8_e4m3fn else None
    args = {
        "exact_key_cache": exact,
        "exact_value_cache": exact,
        "exact_block_tables": jnp.zeros((1, 3), jnp.int32),
        "exact_window": 5,
        "k_scale": scales,
        "v_scale": scales,
        **overrides,
    }
    return kjax.paged_prefill_attention(
        jnp.ones((3, 2, 64), jnp.float16), cache, cache, jnp.zeros((1, 2), jnp.int32),
        jnp.array([0, 3], jnp.int32), jnp.array([5], jnp.int32), 3, **args,
    )  # fmt: skip


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _prefill_exact(exact_key_cache=None, exact_value_cache=None), "go together; give all three"),
        (lambda: _prefill_exact(jnp.float16), "the cache is float16, not float8_e4m3fn"),
        (lambda: _prefill_exact(exact_block_tables=jnp.zeros((2, 3), jnp.int32)), "has 2 rows, expected num"),
        (lambda: _prefill_exact(exact_value_cache=jnp.ones((3, 8, 1, 64), jnp.float16)), "one shape and"),
    ],
)
def test_paged_prefill_attention_kiln_jax_rejects_bad_exact_positions(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_paged_prefill_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    q, cache = jnp.ones((30, 8, 64), jnp.bfloat16), jnp.ones((10, 16, 2, 64), jnp.bfloat16)
    tables, cu = jnp.zeros((3, 4), jnp.int32), jnp.array([0, 5, 9, 30], jnp.int32)
    seq_lens = jnp.array([5, 40, 60], jnp.int32)
    lower_for_tpu(
        lambda q, k, v, t, c, s: paged_prefill_attention_pallas_tpu(
            q, k, v, t, c, s, 21, sliding_window=9, softcap=5.0, interpret=False
        ),
        q, cache, cache, tables, cu, seq_lens,
    )  # fmt: skip


@pytest.mark.parametrize(
    "cache_dtype, block_size", [(jnp.float8_e4m3fn, 16), (jnp.float16, 8), (jnp.float32, 32)]
)
def test_paged_prefill_gpu_kernel_lowers_to_triton(lower_for_gpu, cache_dtype, block_size):
    # The shared lowering test covers the fuzz shapes in bf16; here the fp8 cache with its scales, the
    # small-page path and float32 (IEEE dots), with a window, a soft-cap and GQA 4 (+ a padded group).
    q_dtype = jnp.float16 if cache_dtype == jnp.float8_e4m3fn else cache_dtype
    q, cache = jnp.ones((30, 12, 80), q_dtype), jnp.ones((10, block_size, 3, 80), cache_dtype)
    tables, cu = jnp.zeros((3, 8), jnp.int32), jnp.array([0, 5, 9, 30], jnp.int32)
    seq_lens, scales = jnp.array([5, 40, 60], jnp.int32), jnp.ones((3,), jnp.float32)
    scales = scales if cache_dtype == jnp.float8_e4m3fn else None
    lower_for_gpu(
        lambda q, k, v, t, c, s: paged_prefill_attention_pallas_gpu(
            q, k, v, t, c, s, 21, sliding_window=9, softcap=5.0, k_scale=scales, v_scale=scales,
            interpret=False,
        ),
        q, cache, cache, tables, cu, seq_lens,
    )  # fmt: skip
