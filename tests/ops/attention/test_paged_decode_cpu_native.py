"""The CPU decode attention, with its native kernel (cpu_native.cpp) and with its PyTorch form, against
the float64 reference: GQA groups above the kernel's chunk of 4 query heads, every instantiated head
dim class, bf16 / fp16 / fp32 caches and fp8 ones (with and without exact positions), windows,
lengths on and off block boundaries. The native op called directly: NaN in slots and blocks it must
not read stays out, a block id outside the cache (or the exact caches) raises, every e4m3 value
converts exactly, and an unbuilt head dim is refused."""

import random

import pytest
import torch

from kiln.ops import native_cpu
from kiln.ops.attention.paged_decode_attention import PAGED_DECODE_ATTENTION, cpu_native
from kiln.verify import run_case
from tests.ops.attention.paged_cases import (
    FP8,
    decode_inputs,
    exact_inputs,
    float64_reference,
    poison_exact_reads,
)

SHAPES = [
    # SmolLM2 (9:3), lengths around block boundaries
    {"context_lens": [16, 1, 33, 47], "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "block_size": 16},
    # 8 query heads per KV head: two chunks of four; window shorter than a block
    {"context_lens": [70, 5], "num_heads": 16, "num_kv_heads": 2, "head_dim": 128, "block_size": 16,
     "sliding_window": 9},
    # 6 per KV head (a chunk of 4 and one of 2), head dim 80 (5 AVX-512 vectors), small blocks
    {"context_lens": [29, 64, 3], "num_heads": 6, "num_kv_heads": 1, "head_dim": 80, "block_size": 8},
    {"context_lens": [40], "num_heads": 4, "num_kv_heads": 4, "head_dim": 32, "block_size": 32,
     "sliding_window": 33},
    {"context_lens": [9, 130], "num_heads": 2, "num_kv_heads": 1, "head_dim": 256, "block_size": 16},
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_decode_matches_float64_reference(shape, dtype, native_decode):
    case = run_case(PAGED_DECODE_ATTENTION, "cpu", shape, dtype, torch.device("cpu"), random.randrange(2**31))
    assert case.passed, case


def _poison_unread(inputs: dict, lens: list[int]) -> None:
    """NaN in every cache slot that no sequence reads within its length (the slots past each length,
    the blocks no row reaches; a padding entry of a table may name another row's block, which stays)."""
    tables, block_size = inputs["block_tables"], inputs["key_cache"].shape[1]
    read = torch.zeros(inputs["key_cache"].shape[:2], dtype=torch.bool)
    for row, n in enumerate(lens):
        for pos in range(n):
            read[int(tables[row, pos // block_size]), pos % block_size] = True
    for cache in (inputs["key_cache"], inputs["value_cache"]):
        cache[~read] = float("nan")


def test_native_never_reads_past_a_length_or_outside_the_table(native):
    lens = [5, 40, 17, 16]
    inputs = decode_inputs(torch.device("cpu"), lens, 9, 3, dtype=torch.bfloat16)
    clean = cpu_native.paged_decode(
        inputs["q"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"], inputs["seq_lens"],
        0.125, None,
    )  # fmt: skip
    _poison_unread(inputs, lens)
    out = cpu_native.paged_decode(
        inputs["q"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"], inputs["seq_lens"],
        0.125, None,
    )  # fmt: skip
    assert out.isfinite().all() and torch.equal(out, clean)


@pytest.mark.parametrize("bad_entry", [-1, 10_000])
def test_native_op_raises_on_a_block_outside_the_cache(native, bad_entry):
    q = torch.randn(2, 4, 64)
    cache = torch.randn(4, 16, 2, 64)
    tables = torch.tensor([[0, 1], [2, bad_entry]], dtype=torch.int32)
    lens = torch.tensor([20, 30], dtype=torch.int32)
    with pytest.raises(
        RuntimeError, match=rf"block table entry {bad_entry} is out of range for a cache of 4"
    ):
        torch.ops.kiln_cpu.paged_decode(q, cache, cache, tables, lens, 0.125, -1)
    lens = torch.tensor([20, 16], dtype=torch.int32)  # the bad entry is past the length: never read
    assert torch.ops.kiln_cpu.paged_decode(q, cache, cache, tables, lens, 0.125, -1).isfinite().all()


def test_native_refuses_a_head_dim_it_was_not_built_for(native):
    # 24: three AVX2 vectors, one and a half AVX-512 ones: built on neither (48 is six AVX2 vectors)
    assert not cpu_native.ready(24, torch.float32) and cpu_native.ready(64, torch.bfloat16)
    assert cpu_native.ready(64, torch.float8_e4m3fn) and not cpu_native.ready(24, torch.float8_e4m3fn)
    q, cache = torch.randn(1, 2, 24), torch.randn(2, 16, 1, 24)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head_dim 24 is not built"):
        torch.ops.kiln_cpu.paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), lens, 1.0, -1)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("KILN_CPU_NATIVE", "0")
    assert native_cpu._build() is False


# ---- float8_e4m3fn caches: scales folded in, exact positions read from the exact caches ----

FP8_SHAPES = [
    *SHAPES,
    # exact positions: shorter than a block, windows into the first block, rings wrapping, with a
    # sliding window, the first block only
    {"context_lens": [5, 20, 37, 70], "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "block_size": 16,
     "exact_window": 20},
    {"context_lens": [61, 33], "num_heads": 8, "num_kv_heads": 2, "head_dim": 80, "block_size": 8,
     "exact_window": 16, "sliding_window": 40},
    {"context_lens": [50, 3], "num_heads": 4, "num_kv_heads": 4, "head_dim": 128, "block_size": 16,
     "exact_window": 0},
]  # fmt: skip


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_cpu_decode_fp8_matches_float64_reference(shape, native_decode):
    case = run_case(PAGED_DECODE_ATTENTION, "cpu", shape, FP8, torch.device("cpu"), random.randrange(2**31))
    assert case.passed, case


def test_native_fp8_converts_every_e4m3_value_exactly(native):
    """Each of the 256 bit patterns (subnormals, both zeros, +-448, NaN) as the one key and value of a
    sequence: out = v_scale * value exactly, NaN for e4m3fn's NaN patterns."""
    patterns = torch.arange(256, dtype=torch.uint8).view(FP8)
    head_dim = 64
    cache = patterns.repeat_interleave(head_dim).view(256, 1, 1, head_dim)  # block b holds pattern b
    q = torch.ones(256, 1, head_dim)
    tables = torch.arange(256, dtype=torch.int32)[:, None]
    lens = torch.ones(256, dtype=torch.int32)
    scale = torch.tensor([0.5])
    out = cpu_native.paged_decode_fp8(q, cache, cache, tables, lens, 1.0, None, scale, scale)
    expected = patterns.float() * 0.5
    nan = expected.isnan()
    rows = out[:, 0, :]  # one key: softmax weight 1, out = v_scale * value in every dimension
    assert int(nan.sum()) == 2 and rows[nan].isnan().all()
    assert torch.equal(rows[~nan], expected[~nan, None].expand(-1, head_dim))


@pytest.mark.parametrize("exact_window, sliding_window", [(20, None), (0, None), (13, 30)])
def test_native_fp8_reads_exact_positions_only_from_the_exact_caches(native, exact_window, sliding_window):
    inputs = exact_inputs(torch.device("cpu"), [70, 5, 33, 16], 6, 2, block_size=8, window=exact_window)
    inputs["q"] = inputs["q"].float()
    inputs["sliding_window"] = sliding_window
    expected = float64_reference(PAGED_DECODE_ATTENTION, inputs)
    poison_exact_reads(inputs)
    out = PAGED_DECODE_ATTENTION.implementation("cpu").fn(**inputs)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-5 * float(expected.abs().max()))


def test_native_fp8_raises_on_an_exact_block_outside_the_exact_caches(native):
    inputs = exact_inputs(torch.device("cpu"), [20, 9], 4, 2, block_size=16, window=20, seed=3)
    args = [inputs[k] for k in ("q", "key_cache", "value_cache", "block_tables", "seq_lens")]
    exact = [inputs[k] for k in ("exact_key_cache", "exact_value_cache")]
    tables = inputs["exact_block_tables"].clone()
    tables[1, -1] = inputs["exact_key_cache"].shape[0]
    with pytest.raises(RuntimeError, match="exact block table entry .* out of range"):
        torch.ops.kiln_cpu.paged_decode_fp8(
            *args, 0.125, -1, inputs["k_scale"], inputs["v_scale"], *exact, tables, 20
        )
