import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.attention.paged_prefill_attention import PAGED_PREFILL_ATTENTION
from kiln.verify import assert_close, run_case
from tests.ops.attention.paged_cases import (
    BAD_COMMON,
    BAD_EXACT,
    DTYPES,
    FP8,
    decode_inputs,
    exact_inputs,
    float64_reference,
    poison_exact_reads,
)

PREFILL_SHAPES = [
    # mixed batch: fresh prefill, chunk after a prefix-cache hit (crosses pages), two decodes (q_len 1)
    {"query_lens": [21, 9, 1, 1], "context_lens": [21, 40, 1, 35], "num_heads": 4, "num_kv_heads": 1,
     "head_dim": 64, "block_size": 16},
    {"query_lens": [19], "context_lens": [50], "num_heads": 8, "num_kv_heads": 1, "head_dim": 80,
     "block_size": 8, "sliding_window": 13, "softcap": 5.0},
    {"query_lens": [7, 16], "context_lens": [7, 33], "num_heads": 3, "num_kv_heads": 3, "head_dim": 128,
     "block_size": 16},
]  # fmt: skip


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_paged_prefill_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(PAGED_PREFILL_ATTENTION, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 4, 8]),
    block_size=st.sampled_from([8, 16, 32]),
    window=st.one_of(st.none(), st.integers(1, 50)),
)
def test_paged_prefill_triton_fuzzed_shapes(lens, group, block_size, window, device):
    shape = {
        "query_lens": [q for q, _ in lens],
        "context_lens": [q + extra for q, extra in lens],
        "num_heads": 8,
        "num_kv_heads": 8 // group,
        "head_dim": 64,
        "block_size": block_size,
        "sliding_window": window,
    }
    case = run_case(PAGED_PREFILL_ATTENTION, "triton", shape, torch.float32, device, random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_write_then_chunked_prefill_then_decode_matches_flash_attention(backend, device, monkeypatch):
    """The engine's sequence of calls: write a prompt's K/V into a shuffled paged cache, attend in two
    prefill chunks (the second over the cached prefix), then decode one token; compare every output
    with flash_attention over the same contiguous K/V."""
    monkeypatch.setenv("KILN_BACKEND", backend)
    heads, kv_heads, head_dim, block_size, length = 6, 2, 64, 16, 45
    q = torch.randn(length, heads, head_dim, device=device)
    k = torch.randn(length, kv_heads, head_dim, device=device)
    v = torch.randn(length, kv_heads, head_dim, device=device)
    key_cache = torch.randn(8, block_size, kv_heads, head_dim, device=device)
    value_cache = torch.randn_like(key_cache)
    blocks = torch.randperm(8, device=device)[:3].to(torch.int32)
    block_tables = blocks[None, :]
    positions = torch.arange(length, device=device)
    slots = blocks[positions // block_size].long() * block_size + positions % block_size
    kiln.ops.write_kv_cache(k, v, key_cache, value_cache, slots)

    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    expected = kiln.ops.flash_attention(q, k, v, cu, cu, length, length, causal=True)
    chunks = [(0, 30), (30, 44)]
    for start, end in chunks:
        cu_q = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([end], dtype=torch.int32, device=device)
        out = kiln.ops.paged_prefill_attention(
            q[start:end], key_cache, value_cache, block_tables, cu_q, seq_lens, end - start
        )
        assert_close(out, expected[start:end], 1e-5, f"chunk {start}:{end}")
    seq_lens = torch.tensor([length], dtype=torch.int32, device=device)
    out = kiln.ops.paged_decode_attention(q[length - 1 :], key_cache, value_cache, block_tables, seq_lens)
    assert_close(out, expected[length - 1 :], 1e-5, "decode")


def _prefill_args(**overrides):
    inputs = decode_inputs(torch.device("cpu"), [20, 9], 4, 2)
    inputs["q"] = torch.randn(12, 4, 64).half()
    inputs["cu_seqlens_q"] = torch.tensor([0, 5, 12], dtype=torch.int32)
    inputs["max_seqlen_q"] = 7
    inputs.update(overrides)
    return inputs


@pytest.mark.parametrize(
    "overrides, message",
    [
        *[(o, m) for o, m in BAD_COMMON if "q" not in o],
        ({"q": torch.randn(12, 3, 64).half()}, "not a multiple of the 2 kv heads"),
        ({"cu_seqlens_q": torch.tensor([0, 12], dtype=torch.int32)}, "block_tables has 2 rows"),
        (
            {"cu_seqlens_q": torch.tensor([0, 2, 12], dtype=torch.int32), "max_seqlen_q": 10},
            "10 queries but seq_len 9",
        ),
        ({"max_seqlen_q": 6}, "above max_seqlen 6"),
    ],
)
def test_paged_prefill_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.paged_prefill_attention(**_prefill_args(**overrides))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_paged_prefill_bfloat16_on_gpu(shape):
    case = run_case(PAGED_PREFILL_ATTENTION, "triton", shape, torch.bfloat16, torch.device("cuda"), 1234)
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_paged_prefill_rejects_a_block_table_entry_outside_the_cache(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    q = torch.randn(5, 4, 64, device=device)  # 3 new tokens of a 20-token sequence, 2 of a 30-token one
    cache = torch.randn(4, 16, 2, 64, device=device)
    cu_seqlens_q = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([20, 30], dtype=torch.int32, device=device)
    block_tables = torch.tensor([[0, 1], [2, -7]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -7 is outside the cache's 4 blocks"):
        kiln.ops.paged_prefill_attention(q, cache, cache.clone(), block_tables, cu_seqlens_q, seq_lens, 3)


# ---- an fp8 cache with exact positions (exact_key_cache / exact_value_cache / exact_block_tables) ----

EXACT_SHAPES = [
    s for s in PAGED_PREFILL_ATTENTION.fuzz_shapes(random.Random(0)) if s.get("exact_window") is not None
]


def exact_prefill_inputs(device, query_lens, context_lens, block_size, window, seed=None):
    """exact_inputs' fp8 cache with exact caches (6 heads over 2 kv heads), q float16 for the last
    query_lens[b] tokens of each sequence."""
    inputs = exact_inputs(device, context_lens, 6, 2, block_size, window, seed)
    inputs["q"] = torch.randn(sum(query_lens), 6, 64, device=device).half()
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    inputs["cu_seqlens_q"] = torch.tensor(starts, dtype=torch.int32, device=device)
    inputs["max_seqlen_q"] = max(query_lens)
    return inputs


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("shape", EXACT_SHAPES)
def test_paged_prefill_fp8_exact_positions_match_float64_reference(backend, shape, device):
    """The spec's exact fuzz shapes: a prefill shorter than its first block, chunks whose queries
    straddle the window's start, a decode, a wrapping ring, a sliding window."""
    case = run_case(PAGED_PREFILL_ATTENTION, backend, shape, FP8, device, seed=random.randrange(2**31))
    assert case.passed, case


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 50)), min_size=1, max_size=3),
    block_size=st.sampled_from([8, 16]),
    exact_window=st.integers(0, 40),
    sliding_window=st.one_of(st.none(), st.integers(1, 60)),
)
def test_paged_prefill_triton_fp8_exact_positions_fuzzed(
    lens, block_size, exact_window, sliding_window, device
):
    """Random chunks over random contexts (rings wrap around for the longer ones), windows 0..40."""
    shape = {
        "query_lens": [q for q, _ in lens],
        "context_lens": [q + extra for q, extra in lens],
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "block_size": block_size,
        "exact_window": exact_window,
        "sliding_window": sliding_window,
    }
    case = run_case(PAGED_PREFILL_ATTENTION, "triton", shape, FP8, device, random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("exact_window, sliding_window", [(20, None), (0, None), (13, 30)])
def test_paged_prefill_fp8_reads_exact_positions_only_from_the_exact_caches(
    backend, exact_window, sliding_window, device, monkeypatch
):
    """NaN in the fp8 slots of every exact position and in every exact slot no position maps to: the
    output is still finite and the clean inputs' reference. Chunks of 30 and 12 queries over contexts
    of 70 and 33 (block size 8, rings wrapping): every query reads the window of its sequence's end,
    not of its own position."""
    monkeypatch.setenv("KILN_BACKEND", backend)
    inputs = exact_prefill_inputs(device, [30, 5, 12], [70, 5, 33], block_size=8, window=exact_window)
    inputs["sliding_window"] = sliding_window
    expected = float64_reference(PAGED_PREFILL_ATTENTION, inputs)
    poison_exact_reads(inputs)
    out = kiln.ops.paged_prefill_attention(**inputs)
    assert out.isfinite().all()
    assert_close(out, expected, PAGED_PREFILL_ATTENTION.tolerance[FP8])


@pytest.mark.parametrize("overrides, message", BAD_EXACT)
def test_paged_prefill_rejects_bad_exact_positions(overrides, message):
    inputs = exact_prefill_inputs(torch.device("cpu"), [5, 9], [20, 9], block_size=16, window=20, seed=7)
    inputs.update(overrides)
    with pytest.raises(ValueError, match=f"paged_prefill_attention: .*{message}"):
        kiln.ops.paged_prefill_attention(**inputs)
