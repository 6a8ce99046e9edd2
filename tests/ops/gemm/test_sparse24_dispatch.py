"""kiln.ops.gemm.sparse24_dispatch: a prepared 2:4 weight runs sparse24_linear below the measured
crossover and PyTorch's semi-structured GEMM from there on; the crossover comes from timings (cached
in the tuning cache, so a second load times nothing); KILN_SPARSE24_DISPATCH overrides it."""

import pytest
import torch

import kiln.ops
import kiln.ops.gemm.quantized_layouts as quantized_layouts
from kiln.ops.gemm import sparse24_dispatch
from kiln.ops.gemm.sparse24_dispatch import (
    CANDIDATE_ROWS,
    cached_crossover,
    crossover_from_timings,
    prepare_sparse24_dispatch,
)
from kiln.quant.sparse24 import Sparse24Weight, compress_24, decompress_24, prune_24
from kiln.verify import relative_error


@pytest.mark.parametrize(
    ("timings", "expected"),
    [
        ({16: (1, 2), 64: (1, 2), 256: (2, 1), 1024: (4, 1)}, 256),
        ({16: (1, 2), 64: (1, 0.5), 256: (2, 3), 1024: (4, 1)}, 1024),  # a win below a loss: not it
        ({16: (1, 2), 64: (1, 2)}, None),
        ({16: (2, 1), 64: (2, 1)}, 16),
        ({16: (1, 1)}, None),  # a tie keeps Kiln's kernel
    ],
)
def test_crossover_is_the_fewest_rows_from_which_semi_structured_always_wins(timings, expected):
    assert crossover_from_timings(timings) == expected


def _weight(n=24, k=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return prune_24(torch.randn(n, k, generator=g))


def test_the_crossover_is_timed_once_then_read_from_the_tuning_cache():
    values, meta = compress_24(_weight())
    semi = decompress_24(values, meta)  # a dense stand-in: the CPU has no semi-structured GEMM
    script = {rows: (1.0, 2.0) if rows < 256 else (2.0, 1.0) for rows in CANDIDATE_ROWS}
    calls = []

    def seconds(fn):
        fn()  # both GEMMs really run
        rows = CANDIDATE_ROWS[len(calls) // 2]
        calls.append(rows)
        return script[rows][(len(calls) - 1) % 2]

    assert cached_crossover(values, meta, lambda: semi, seconds) == 256
    assert len(calls) == 2 * len(CANDIDATE_ROWS)

    def must_not_time(fn):
        raise AssertionError("timed again")

    def must_not_build():
        raise AssertionError("built a semi-structured copy with the crossover cached")

    assert cached_crossover(values, meta, must_not_build, must_not_time) == 256
    # never faster is cached too, as "no crossover"
    other_values, other_meta = compress_24(_weight(n=8, k=16))
    slow = {rows: (1.0, 2.0) for rows in CANDIDATE_ROWS}
    calls.clear()
    other_dense = decompress_24(other_values, other_meta)
    assert cached_crossover(other_values, other_meta, lambda: other_dense, seconds_of(slow)) is None
    assert cached_crossover(other_values, other_meta, must_not_build, must_not_time) is None
    # no semi-structured copy for a shape: no crossover, and nothing is timed
    third_values, third_meta = compress_24(_weight(n=16, k=24))
    assert cached_crossover(third_values, third_meta, lambda: None, must_not_time) is None


def seconds_of(script):
    counter = []

    def seconds(fn):
        rows = CANDIDATE_ROWS[len(counter) // 2]
        counter.append(rows)
        return script[rows][(len(counter) - 1) % 2]

    return seconds


@pytest.mark.parametrize("rows", [3, 4, 9])
def test_prepared_sparse24_semi_runs_each_side_of_the_crossover(rows, monkeypatch):
    weight = _weight()
    values, meta = compress_24(weight)
    dense = decompress_24(values, meta)
    layout_tensors = (values, meta, dense, torch.tensor(4))  # crossover at 4 rows
    used = []
    real_linear, real_sparse = torch.nn.functional.linear, quantized_layouts.sparse24_linear
    monkeypatch.setattr(
        quantized_layouts.torch.nn.functional, "linear", lambda *a: used.append("semi") or real_linear(*a)
    )
    monkeypatch.setattr(
        quantized_layouts, "sparse24_linear", lambda *a: used.append("kiln") or real_sparse(*a)
    )
    x = torch.randn(rows, 40)
    bias = torch.randn(24)
    y = kiln.ops.prepared_linear(x, "sparse24_semi", layout_tensors, bias, None)
    assert used[0] == ("semi" if rows >= 4 else "kiln")  # (the CPU sparse24_linear calls F.linear itself)
    assert "kiln" not in used if rows >= 4 else True
    assert relative_error(y, x.double() @ weight.double().T + bias.double()) < 1e-5


def test_prepared_sparse24_semi_with_a_bad_crossover_tensor_is_named():
    values, meta = compress_24(_weight())
    bad = (values, meta, decompress_24(values, meta), torch.tensor(4.0))
    with pytest.raises(ValueError, match=r"weight\[3\]"):
        kiln.ops.prepared_linear(torch.randn(2, 40), "sparse24_semi", bad, None, None)


def test_no_dispatch_on_the_cpu_and_a_bad_mode_is_named(monkeypatch):
    values, meta = compress_24(_weight())
    assert prepare_sparse24_dispatch(values.half(), meta) == ()
    cpu = torch.device("cpu")
    layout, tensors = quantized_layouts.sparse24_layout(Sparse24Weight(values, meta), cpu, torch.float16)
    assert layout == "sparse24" and len(tensors) == 2
    monkeypatch.setenv("KILN_SPARSE24_DISPATCH", "cusparse")
    with pytest.raises(ValueError, match="KILN_SPARSE24_DISPATCH='cusparse', expected one of auto, triton"):
        sparse24_dispatch.dispatch_mode()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "semi_structured", "triton"])
def test_cuda_prepared_2to4_weight_matches_the_reference_on_both_sides(mode, monkeypatch):
    monkeypatch.setenv("KILN_SPARSE24_DISPATCH", mode)
    weight = prune_24(torch.randn(1024, 1024) * 1024**-0.5)
    values, meta = compress_24(weight)
    layout, tensors = quantized_layouts.sparse24_layout(
        Sparse24Weight(values, meta), torch.device("cuda"), torch.bfloat16
    )
    assert layout == ("sparse24" if mode == "triton" else layout)
    if mode == "semi_structured":
        assert layout == "sparse24_semi"
    for rows in (1, 16, 256, 2048):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        y = kiln.ops.prepared_linear(x, layout, tensors, None, None)
        ref = x.double() @ decompress_24(values, meta, torch.float64).cuda().T
        assert relative_error(y, ref) < 1e-2, (mode, rows)
