import random
import textwrap

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.attention.paged_decode_attention import PAGED_DECODE_ATTENTION
from kiln.ops.attention.paged_decode_attention import triton as decode_triton
from kiln.ops.attention.paged_decode_attention.triton import paged_decode_attention_triton
from kiln.ops.attention.reference import gather_paged
from kiln.verify import assert_close, run_case
from tests.ops.attention.paged_cases import (
    BAD_COMMON,
    BAD_EXACT,
    DTYPES,
    FP8,
    assert_triton_child_prints_ok,
    decode_inputs,
    exact_inputs,
    float64_reference,
    poison_exact_reads,
)

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
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_paged_decode_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(PAGED_DECODE_ATTENTION, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


@settings(max_examples=6, deadline=None)
@given(
    context_lens=st.lists(st.integers(1, 80), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 4, 8]),
    block_size=st.sampled_from([8, 16, 32]),
    window=st.one_of(st.none(), st.integers(1, 50)),
)
def test_paged_decode_triton_fuzzed_shapes(context_lens, group, block_size, window, device):
    shape = {
        "context_lens": context_lens,
        "num_heads": 8,
        "num_kv_heads": 8 // group,
        "head_dim": 64,
        "block_size": block_size,
        "sliding_window": window,
    }
    case = run_case(PAGED_DECODE_ATTENTION, "triton", shape, torch.float32, device, random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode_agrees_with_torch_sdpa_for_gqa_ratios(group, device):
    """torch's SDPA on the gathered, contiguous context is a second witness, for both backends."""
    inputs = decode_inputs(device, [50, 17, 33], 8, 8 // group)
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
    inputs = decode_inputs(device, [70, 3, 64], 9, 3, block_size=16, dtype=torch.float32)
    config = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "partition_size": partition_size}
    out = paged_decode_attention_triton(**inputs, config=config)
    expected = PAGED_DECODE_ATTENTION.reference(
        **{k: v.double() if k == "q" else v for k, v in inputs.items()}
    )
    assert_close(out, expected, 2e-5)


def test_fuzz_shapes_reach_the_split_k_combine_on_a_gpu(monkeypatch):
    """`kiln verify` on a GPU must run the partition + combine kernels, not only the single-split one:
    some fuzz shape is split in several partitions by the launcher's GPU heuristic (>= 256 tokens a
    partition; the interpreter's 32 split every shape). The split count as the launcher computes it."""
    monkeypatch.setattr(decode_triton, "triton_interpreting", lambda: False)  # the GPU's heuristic config
    cpu, splits = torch.device("cpu"), []
    for shape in PAGED_DECODE_ATTENTION.fuzz_shapes(random.Random(0)):
        inputs = PAGED_DECODE_ATTENTION.make_inputs(shape, torch.float16, cpu, torch.Generator())
        num_seqs, page_size, num_kv_heads = len(inputs["seq_lens"]), *inputs["key_cache"].shape[1:3]
        granule = max(decode_triton._heuristic_config(shape["head_dim"])["BLOCK_N"], page_size)
        capacity = inputs["block_tables"].shape[1] * page_size
        partition = decode_triton._partition_size(num_seqs, num_kv_heads, capacity, granule, cpu)  # 132 SMs
        partition = triton.cdiv(max(partition, triton.cdiv(capacity, decode_triton.MAX_SPLITS)), granule)
        splits.append(triton.cdiv(capacity, partition * granule))
    assert max(splits) > 1, splits


def test_paged_decode_never_reads_pages_before_the_window(device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")
    inputs = decode_inputs(device, [96], 4, 2, dtype=torch.float32)
    expected = kiln.ops.paged_decode_attention(**inputs, sliding_window=20)
    for page in inputs["block_tables"][0, :4].tolist():  # tokens 0..63: before 96 - 20 and tile-aligned
        inputs["key_cache"][page] = float("nan")
        inputs["value_cache"][page] = float("nan")
    assert_close(kiln.ops.paged_decode_attention(**inputs, sliding_window=20), expected, 0.0)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("softcap, sliding_window", [(None, None), (None, 8), (5.0, None)])
def test_paged_decode_never_lets_stale_nan_past_a_sequence_length_through(
    backend, softcap, sliding_window, device, monkeypatch
):
    """Cache slots at or past a sequence's seq_len are never read (issue #17 item 7): NaN there, in the
    last block of a short sequence batched with a longer one, must not reach its output."""
    monkeypatch.setenv("KILN_BACKEND", backend)
    key_cache = torch.full((2, 16, 1, 64), float("nan"), device=device)
    value_cache = key_cache.clone()
    key_cache[0, :1], value_cache[0, :1] = 1.0, 1.0  # sequence 0: one token, then 15 stale NaN slots
    key_cache[1], value_cache[1] = 1.0, 1.0  # sequence 1: a full block
    block_tables = torch.tensor([[0], [1]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([1, 16], dtype=torch.int32, device=device)
    q = torch.ones(2, 1, 64, device=device)
    out = kiln.ops.paged_decode_attention(
        q, key_cache, value_cache, block_tables, seq_lens, softcap=softcap, sliding_window=sliding_window
    )
    assert torch.equal(out, torch.ones_like(out)), out[:, 0, :2]


def test_paged_decode_cpu_ignores_nan_in_unread_slots_of_a_ragged_batch():
    """A ragged batch whose unread slots are all NaN (past each sequence's length in its own blocks, and
    every block no sequence owns, which padding block-table entries may point at) still gives the
    float64 reference's result on the CPU path, fp8 cache included."""
    for dtype in (torch.float32, torch.float8_e4m3fn):
        inputs = decode_inputs(torch.device("cpu"), [5, 40, 17], 6, 2, dtype=dtype)
        block_size = inputs["key_cache"].shape[1]
        unread = torch.ones(inputs["key_cache"].shape[:2], dtype=torch.bool)  # [num_blocks, block_size]
        for table, length in zip(inputs["block_tables"].tolist(), inputs["seq_lens"].tolist(), strict=True):
            for t in range(length):
                unread[table[t // block_size], t % block_size] = False
        for cache in (inputs["key_cache"], inputs["value_cache"]):
            if cache.dtype == torch.float8_e4m3fn:
                cache.view(torch.uint8)[unread] = 0x7F  # e4m3fn's NaN (no fp8 masked_fill on the CPU)
            else:
                cache[unread] = float("nan")
        expected = PAGED_DECODE_ATTENTION.reference(
            **{k: v.double() if k == "q" else v for k, v in inputs.items()}
        )
        out = PAGED_DECODE_ATTENTION.implementation("cpu").fn(**inputs)
        assert_close(out, expected, PAGED_DECODE_ATTENTION.tolerance[dtype], str(dtype))


def _decode_args(**overrides):
    inputs = decode_inputs(torch.device("cpu"), [20, 9], 4, 2)
    inputs.update(overrides)
    return inputs


@pytest.mark.parametrize("overrides, message", BAD_COMMON)
def test_paged_decode_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.paged_decode_attention(**_decode_args(**overrides))


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


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("bad_entry", [1000, 2**31 - 1, -1])
def test_paged_decode_rejects_a_block_table_entry_outside_the_cache(backend, bad_entry, device, monkeypatch):
    # Before the check, 1000 / 2**31-1 segfaulted the Triton kernel and the CPU path silently read the
    # last block; -1 gave wrong values. Entries past a sequence's length stay free (padding).
    monkeypatch.setenv("KILN_BACKEND", backend)
    q = torch.randn(2, 4, 64, device=device)
    cache = torch.randn(4, 16, 2, 64, device=device)
    seq_lens = torch.tensor([20, 30], dtype=torch.int32, device=device)
    bad = torch.tensor([[0, 1], [2, bad_entry]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = .* outside the cache's 4 blocks"):
        kiln.ops.paged_decode_attention(q, cache, cache.clone(), bad, seq_lens)
    padded = torch.tensor([[0, bad_entry], [2, 1]], dtype=torch.int32, device=device)
    out = kiln.ops.paged_decode_attention(q, cache, cache.clone(), padded, seq_lens.new_tensor([16, 30]))
    assert out.isfinite().all()


# ---- an fp8 cache with exact positions (exact_key_cache / exact_value_cache / exact_block_tables) ----

EXACT_SHAPES = [
    s for s in PAGED_DECODE_ATTENTION.fuzz_shapes(random.Random(0)) if s.get("exact_window") is not None
]


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("shape", EXACT_SHAPES)
def test_paged_decode_fp8_exact_positions_match_float64_reference(backend, shape, device):
    """The spec's exact fuzz shapes: a context shorter than its first block, windows reaching into the
    first block, rings wrapping around, with a sliding window, and exact_window 0 (first block only)."""
    case = run_case(PAGED_DECODE_ATTENTION, backend, shape, FP8, device, seed=random.randrange(2**31))
    assert case.passed, case


@settings(max_examples=6, deadline=None)
@given(
    context_lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    group=st.sampled_from([1, 3]),
    block_size=st.sampled_from([8, 16]),
    exact_window=st.integers(0, 40),
    sliding_window=st.one_of(st.none(), st.integers(1, 60)),
)
def test_paged_decode_triton_fp8_exact_positions_fuzzed(
    context_lens, group, block_size, exact_window, sliding_window, device
):
    """Random contexts (the ring of make_exact_kv wraps around for the longer ones), windows 0..40."""
    shape = {
        "context_lens": context_lens,
        "num_heads": 3 * group,
        "num_kv_heads": 3,
        "head_dim": 64,
        "block_size": block_size,
        "exact_window": exact_window,
        "sliding_window": sliding_window,
    }
    case = run_case(PAGED_DECODE_ATTENTION, "triton", shape, FP8, device, random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("partition_size", [16, 48, 4096])
def test_paged_decode_triton_split_k_reads_exact_positions_in_every_partition(partition_size, device):
    """Partitions of 16 / 48 tokens (the window and the first block in different partitions, a window
    across a partition edge) and a single one; block size 8 so partitions cut through the ring."""
    inputs = exact_inputs(device, [90, 7, 41], 6, 2, block_size=8, window=21)
    config = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "partition_size": partition_size}
    out = paged_decode_attention_triton(**inputs, config=config)
    expected = float64_reference(PAGED_DECODE_ATTENTION, inputs)
    assert_close(out, expected, PAGED_DECODE_ATTENTION.tolerance[FP8])


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("exact_window, sliding_window", [(20, None), (0, None), (13, 30)])
def test_paged_decode_fp8_reads_exact_positions_only_from_the_exact_caches(
    backend, exact_window, sliding_window, device, monkeypatch
):
    """NaN in the fp8 slots of every exact position and in every exact slot no position maps to: the
    output is still finite and the clean inputs' reference, so each position is read from the cache
    the contract names and the ring entry exact_slot names (block size 8: rings wrap around)."""
    monkeypatch.setenv("KILN_BACKEND", backend)
    inputs = exact_inputs(device, [70, 5, 33], 6, 2, block_size=8, window=exact_window)
    inputs["sliding_window"] = sliding_window
    expected = float64_reference(PAGED_DECODE_ATTENTION, inputs)
    poison_exact_reads(inputs)
    out = kiln.ops.paged_decode_attention(**inputs)
    assert out.isfinite().all()
    assert_close(out, expected, PAGED_DECODE_ATTENTION.tolerance[FP8])


def _exact_args(**overrides):
    inputs = exact_inputs(torch.device("cpu"), [20, 9], 4, 2, block_size=16, window=20, seed=7)
    inputs.update(overrides)
    return inputs


@pytest.mark.parametrize("overrides, message", BAD_EXACT)
def test_paged_decode_rejects_bad_exact_positions(overrides, message):
    with pytest.raises(ValueError, match=f"paged_decode_attention: .*{message}"):
        kiln.ops.paged_decode_attention(**_exact_args(**overrides))


_BAD_EXACT_IDS_CHILD = textwrap.dedent(
    """
    import sys, torch, kiln.ops
    from kiln.ops.attention.paged_inputs import make_paged_kv
    device = torch.device(sys.argv[1])
    gen = torch.Generator().manual_seed(0)
    inputs = make_paged_kv([40, 70], 2, 64, 16, torch.float8_e4m3fn, device, gen, exact_window=20)
    exact_tables = inputs["exact_block_tables"]
    prefill = {"q": torch.randn(9, 4, 64, device=device).half(), "max_seqlen_q": 5,
               "cu_seqlens_q": torch.tensor([0, 4, 9], dtype=torch.int32, device=device)}
    with kiln.ops.trusted_inputs():
        for bad in (1000, 2**31 - 1, -1, -(2**31)):
            inputs["exact_block_tables"] = exact_tables.clone()
            inputs["exact_block_tables"][0, 0] = bad  # sequence 0's first block
            inputs["exact_block_tables"][1, 1:] = bad  # sequence 1's whole ring
            out = kiln.ops.paged_decode_attention(torch.randn(2, 4, 64, device=device).half(), **inputs)
            assert out.isfinite().all(), ("decode", bad)
            out = kiln.ops.paged_prefill_attention(**prefill, **inputs)
            assert out.isfinite().all(), ("prefill", bad)
    print("ok")
    """
)  # fmt: skip


def test_triton_exact_positions_stay_inside_the_exact_caches_with_unchecked_bad_ids(device):
    """Inside kiln.ops.trusted_inputs() exact_block_tables is not checked: a bad entry (first block or
    ring) gives wrong values for its own sequence but no read outside the exact caches (they are
    clamped like the block tables). A child process, as an out-of-bounds read may kill it."""
    assert_triton_child_prints_ok(_BAD_EXACT_IDS_CHILD, device)
