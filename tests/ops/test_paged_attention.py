import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.attention.inputs import make_paged_kv
from kiln.ops.attention.paged_decode import PAGED_DECODE_ATTENTION
from kiln.ops.attention.paged_decode_triton import paged_decode_attention_triton
from kiln.ops.attention.paged_prefill import PAGED_PREFILL_ATTENTION
from kiln.ops.attention.reference import gather_paged
from kiln.verify import assert_close, run_case

DTYPES = [torch.float32, torch.float16, torch.float8_e4m3fn]  # fp8: float16 queries over an fp8 cache

PREFILL_SHAPES = [
    # mixed batch: fresh prefill, chunk after a prefix-cache hit (crosses pages), two decodes (q_len 1)
    {"query_lens": [21, 9, 1, 1], "context_lens": [21, 40, 1, 35], "num_heads": 4, "num_kv_heads": 1,
     "head_dim": 64, "block_size": 16},
    {"query_lens": [19], "context_lens": [50], "num_heads": 8, "num_kv_heads": 1, "head_dim": 80,
     "block_size": 8, "sliding_window": 13, "softcap": 5.0},
    {"query_lens": [7, 16], "context_lens": [7, 33], "num_heads": 3, "num_kv_heads": 3, "head_dim": 128,
     "block_size": 16},
]  # fmt: skip

DECODE_SHAPES = [
    {"context_lens": [1], "num_heads": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16},
    # SmolLM2's heads (9:3), lengths around page boundaries
    {"context_lens": [37, 1, 16, 70], "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "block_size": 16},
    {"context_lens": [45, 33], "num_heads": 8, "num_kv_heads": 1, "head_dim": 80, "block_size": 8,
     "sliding_window": 20, "softcap": 5.0},
    {"context_lens": [100], "num_heads": 4, "num_kv_heads": 4, "head_dim": 256, "block_size": 32},
]  # fmt: skip


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_paged_prefill_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(PAGED_PREFILL_ATTENTION, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_paged_decode_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(PAGED_DECODE_ATTENTION, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 4, 8]),
    block_size=st.sampled_from([8, 16, 32]),
    window=st.one_of(st.none(), st.integers(1, 50)),
)
def test_paged_prefill_and_decode_triton_fuzzed_shapes(lens, group, block_size, window):
    query_lens = [q for q, _ in lens]
    shape = {
        "query_lens": query_lens,
        "context_lens": [q + extra for q, extra in lens],
        "num_heads": 8,
        "num_kv_heads": 8 // group,
        "head_dim": 64,
        "block_size": block_size,
        "sliding_window": window,
    }
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # no fixtures under hypothesis
    seed = random.randrange(2**31)
    case = run_case(PAGED_PREFILL_ATTENTION, "triton", shape, torch.float32, device, seed)
    assert case.passed, case
    shape = {k: v for k, v in shape.items() if k != "query_lens"}
    case = run_case(PAGED_DECODE_ATTENTION, "triton", shape, torch.float32, device, seed + 1)
    assert case.passed, case


def _decode_inputs(device, context_lens, heads, kv_heads, head_dim=64, block_size=16, dtype=torch.float16):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    inputs = make_paged_kv(context_lens, kv_heads, head_dim, block_size, dtype, device, gen)
    q_dtype = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    inputs["q"] = torch.randn(len(context_lens), heads, head_dim, generator=gen).to(q_dtype).to(device)
    return inputs


@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode_agrees_with_torch_sdpa_for_gqa_ratios(group, device):
    """torch's SDPA on the gathered, contiguous context is a second witness, for both backends."""
    inputs = _decode_inputs(device, [50, 17, 33], 8, 8 // group)
    outs = {
        "triton": paged_decode_attention_triton(**inputs),
        "cpu": PAGED_DECODE_ATTENTION.implementation("cpu").fn(**inputs),
    }
    for b, length in enumerate(inputs["seq_lens"].tolist()):
        k = gather_paged(inputs["key_cache"], inputs["block_tables"][b], length, None).float().transpose(0, 1)
        v = (
            gather_paged(inputs["value_cache"], inputs["block_tables"][b], length, None)
            .float()
            .transpose(0, 1)
        )
        q = inputs["q"][b].float()[:, None]  # [H, 1, D]
        expected = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        )
        for name, out in outs.items():
            assert_close(out[b], expected[:, 0], 2e-3, f"{name}, sequence {b}")


@pytest.mark.parametrize("partition_size", [16, 48, 4096])
def test_paged_decode_split_counts_agree(partition_size, device):
    """Many partitions (two-kernel path, partitions not aligned to pages), and one (direct path)."""
    inputs = _decode_inputs(device, [70, 3, 64], 9, 3, block_size=16, dtype=torch.float32)
    config = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "partition_size": partition_size}
    out = paged_decode_attention_triton(**inputs, config=config)
    expected = PAGED_DECODE_ATTENTION.reference(
        **{k: v.double() if k == "q" else v for k, v in inputs.items()}
    )
    assert_close(out, expected, 2e-5)


def test_paged_decode_never_reads_pages_before_the_window(device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")
    inputs = _decode_inputs(device, [96], 4, 2, dtype=torch.float32)
    expected = kiln.ops.paged_decode_attention(**inputs, sliding_window=20)
    for page in inputs["block_tables"][0, :4].tolist():  # tokens 0..63: before 96 - 20 and tile-aligned
        inputs["key_cache"][page] = float("nan")
        inputs["value_cache"][page] = float("nan")
    assert_close(kiln.ops.paged_decode_attention(**inputs, sliding_window=20), expected, 0.0)


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
    inputs = _decode_inputs(torch.device("cpu"), [20, 9], 4, 2)
    inputs["q"] = torch.randn(12, 4, 64).half()
    inputs["cu_seqlens_q"] = torch.tensor([0, 5, 12], dtype=torch.int32)
    inputs["max_seqlen_q"] = 7
    inputs.update(overrides)
    return inputs


def _decode_args(**overrides):
    inputs = _decode_inputs(torch.device("cpu"), [20, 9], 4, 2)
    inputs.update(overrides)
    return inputs


BAD_COMMON = [
    ({"q": torch.randn(2, 3, 64).half()}, "not a multiple of the 2 kv heads"),
    ({"q": torch.randn(2, 4, 48).half()}, "head_dim 48, supported head dims"),
    ({"q": torch.randn(2, 4, 64)}, "key_cache is float16 but the data is float32"),
    (
        {"block_tables": torch.zeros(2, 1, dtype=torch.int32)},
        "seq_len 20 but block_tables rows hold only 1 blocks",
    ),
    ({"block_tables": torch.zeros(2, 2, dtype=torch.int64)}, "block_tables has dtype int64"),
    ({"seq_lens": torch.tensor([20, 9])}, "seq_lens has dtype int64"),
    ({"seq_lens": torch.tensor([20], dtype=torch.int32)}, "seq_lens 1 entries"),
    ({"k_scale": torch.ones(2), "v_scale": torch.ones(2)}, "apply only to float8_e4m3fn"),
    ({"key_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float16)}, "must have one shape and dtype"),
    (
        {"key_cache": torch.zeros(4, 12, 2, 64).half(), "value_cache": torch.zeros(4, 12, 2, 64).half()},
        "power of two",
    ),
    ({"sliding_window": 0}, "sliding_window must be positive"),
]


@pytest.mark.parametrize("overrides, message", BAD_COMMON)
def test_paged_decode_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.paged_decode_attention(**_decode_args(**overrides))


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


def test_fp8_cache_without_scales_is_rejected():
    inputs = _decode_args()
    fp8 = inputs["key_cache"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="so k_scale"):
        kiln.ops.paged_decode_attention(
            inputs["q"], fp8, fp8.clone(), inputs["block_tables"], inputs["seq_lens"]
        )


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_paged_decode_bfloat16_on_gpu(shape):
    case = run_case(PAGED_DECODE_ATTENTION, "triton", shape, torch.bfloat16, torch.device("cuda"), 1234)
    assert case.passed, case


@pytest.mark.gpu
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_paged_prefill_bfloat16_on_gpu(shape):
    case = run_case(PAGED_PREFILL_ATTENTION, "triton", shape, torch.bfloat16, torch.device("cuda"), 1234)
    assert case.passed, case


@pytest.mark.gpu
def test_paged_decode_long_context_batch_one_on_gpu():
    shape = {
        "batch": 1,
        "context": 20000,
        "num_heads": 32,
        "num_kv_heads": 4,
        "head_dim": 128,
        "block_size": 16,
    }
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        case = run_case(PAGED_DECODE_ATTENTION, "triton", shape, dtype, torch.device("cuda"), 99)
        assert case.passed, case
