import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.attention.paged_prefill_attention import PAGED_PREFILL_ATTENTION
from kiln.verify import assert_close, run_case
from tests.ops.attention.paged_cases import BAD_COMMON, DTYPES, decode_inputs

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
