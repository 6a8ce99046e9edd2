"""paged_decode_attention's JAX backends (the Pallas TPU kernel, the Pallas GPU kernel, XLA) against
the spec's float64 reference through the torch-facing implementations, and the generated kiln.jax
entry; an fp8 cache's exact positions included."""

import functools
import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.attention.jax_common import decode_page_range  # noqa: E402
from kiln.ops.attention.jax_exact import exact_physical_page  # noqa: E402
from kiln.ops.attention.paged_decode_attention.pallas_tpu import paged_decode_attention_pallas_tpu  # noqa: E402
from kiln.ops.attention.paged_decode_attention.spec import (  # noqa: E402
    EXACT_FUZZ_SHAPES,
    EXACT_WINDOW_WITH_SLIDING_WINDOW,
)
from kiln.ops.attention.reference import exact_positions, exact_slot  # noqa: E402
from kiln.verify import run_case  # noqa: E402
from tests.ops.attention.paged_cases import jax_jit_against_torch_cpu, tightest_exact_ring_error  # noqa: E402

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


# With exact positions (fp8 caches only): the spec's fuzz shapes (EXACT_FUZZ_SHAPES) and this one. The
# input maker draws the exact caches independently of the fp8 cache and gives each sequence a ring one
# entry wider than its window needs, so an exact position read from the fp8 cache, the wrong ring entry
# or the wrong offset is far off.
EXACT_TIGHT_RING = {  # the spec's input maker gives R one column more than the contract's least
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


def test_exact_shapes_are_the_specs():
    spec_shapes = [s for s in get_op("paged_decode_attention").fuzz_shapes(random.Random(0))[:-1]]
    assert all(shape in spec_shapes for shape in EXACT_FUZZ_SHAPES)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
@pytest.mark.parametrize(
    "shape", EXACT_FUZZ_SHAPES, ids=["ring_wraps_short_sequence", "sliding_window", "first_block_only"]
)
def test_paged_decode_attention_reads_exact_positions_of_an_fp8_cache_matches_float64(backend, shape):
    op = get_op("paged_decode_attention")
    case = run_case(op, backend, shape, torch.float8_e4m3fn, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu", "xla"])
def test_paged_decode_attention_tightest_exact_ring_matches_float64(backend):
    """R = ceil(W / block_size) ring columns, the fewest the contract allows: a window over R + 1
    pages (seq_len 50: positions 30..49 on pages 1, 2, 3) has its first and last pages in one ring
    block, at different offsets."""
    error = tightest_exact_ring_error("paged_decode_attention", backend, EXACT_TIGHT_RING)  # R = 2
    assert error < get_op("paged_decode_attention").tolerance[torch.float8_e4m3fn]


@pytest.mark.parametrize("implementation", ["pallas_tpu", "pallas_gpu", "xla"])
def test_kiln_jax_paged_decode_attention_with_exact_positions_under_jit_matches_torch_cpu(implementation):
    error, static, arrays = jax_jit_against_torch_cpu(
        "paged_decode_attention", implementation, shape=EXACT_WINDOW_WITH_SLIDING_WINDOW
    )
    assert static["exact_window"] == 16 and "exact_block_tables" in arrays
    assert error < 2e-3


@functools.partial(jax.jit, static_argnames=("block_size", "pages", "window", "exact_window", "ring"))
def _held_exact_blocks(tables, *, block_size, pages, window, exact_window, ring):
    """int32 [seq_len - 1, page]: the exact block the TPU decode kernel's exact index map names for each
    grid step of one sequence of every seq_len in [1, pages * block_size]."""

    def held(seq_len, page):
        first, last = decode_page_range(seq_len, block_size, window)
        return exact_physical_page(tables, 0, page, first, last, seq_len, block_size, exact_window, ring)[0]

    seq_lens = jnp.arange(1, pages * block_size + 1, dtype=jnp.int32)
    return jax.vmap(lambda n: jax.vmap(lambda i: held(n, i))(jnp.arange(pages, dtype=jnp.int32)))(seq_lens)


def test_paged_tpu_exact_index_map_holds_each_pages_exact_block_without_extra_copies():
    """Every visible page with an exact slot holds the block exact_slot names for it, and along one
    sequence's pages the exact caches' block index changes only where the next exact page needs
    another block (Pallas copies a block when its index changes): pages without exact slots cost no
    copy. With and without a sliding window; W = 0, tight rings (R = ceil(W / block_size), the
    window's first and last pages sharing a ring block) and wider ones."""
    block_size, pages = 8, 10
    tables = np.random.default_rng(0).permutation(40)[:6].reshape(1, 6).astype(np.int32)
    for window in (None, 20):
        for exact_window, ring in ((0, 0), (8, 1), (9, 2), (24, 3), (9, 5), (30, 5)):
            held = np.asarray(
                _held_exact_blocks(
                    jnp.asarray(tables), block_size=block_size, pages=pages, window=window,
                    exact_window=exact_window, ring=ring,
                )
            ).tolist()  # fmt: skip
            row = tables[0, : 1 + ring].tolist()
            for seq_len, steps in enumerate(held, start=1):
                first, last = (int(x) for x in decode_page_range(seq_len, block_size, window))
                needed = {}  # visible page -> its exact block
                for j in exact_positions(seq_len, block_size, exact_window):
                    if first * block_size <= j < (last + 1) * block_size:
                        needed[j // block_size] = exact_slot(row, j, block_size)[0]
                for page, block in needed.items():
                    assert steps[page] == block, (window, exact_window, seq_len, page)
                blocks = [needed[page] for page in sorted(needed)]
                runs = 1 + sum(a != b for a, b in zip(blocks, blocks[1:], strict=False))
                copies = 1 + sum(a != b for a, b in zip(steps, steps[1:], strict=False))
                assert copies == runs, (window, exact_window, seq_len, steps)


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


def _decode_exact(**overrides):
    """An fp8 decode with exact positions through kiln.jax, one argument replaced."""
    cache, scales = jnp.ones((8, 16, 1, 64), jnp.float8_e4m3fn), jnp.ones((1,), jnp.float32)
    args = {
        "exact_key_cache": jnp.ones((4, 16, 1, 64), jnp.float16),
        "exact_value_cache": jnp.ones((4, 16, 1, 64), jnp.float16),
        "exact_block_tables": jnp.zeros((2, 3), jnp.int32),
        "exact_window": 10,
        **overrides,
    }
    q, tables, seq_lens = (
        jnp.ones((2, 4, 64), jnp.float16),
        jnp.zeros((2, 3), jnp.int32),
        jnp.ones(2, jnp.int32),
    )
    return kjax.paged_decode_attention(
        q, cache, cache, tables, seq_lens, k_scale=scales, v_scale=scales, **args
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _decode(12), "block_size \\(dim 1\\) is 12, expected a power of two"),
        (lambda: _decode(16, jnp.float8_e4m3fn), "so k_scale .* is required"),
        (lambda: _decode_exact(exact_value_cache=None), "go together; give all three or none"),
        (lambda: _decode_exact(exact_block_tables=jnp.zeros((2, 1), jnp.int32)), "widen it to 2 columns"),
        (
            lambda: _decode_exact(exact_key_cache=jnp.ones((4, 16, 1, 64))),
            "exact_key_cache has dtype float32",
        ),
        (lambda: _decode_exact(exact_window=-1), "exact_window must be a non-negative int"),
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
