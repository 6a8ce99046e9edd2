"""kiln.ops.gemm.cpu_kquants_a8: GGUF Q4_K / Q5_K / Q6_K blocks as the file stores them times x
quantized to Q8_K (per 256 values), the "kquants_a8" layout's kernels (the a8 formats' K-quant weights,
every row count, each row as it would be alone). References not
written by Kiln: `gguf` decodes the weights' blocks, and its Q8_0 rounding applied to whole 256-value
blocks gives x's int8 values (ggml's reference rounding; Kiln's packer writes the K-quant blocks, which
gguf cannot)."""

import random

import numpy as np
import pytest
import torch

import kiln.ops
from kiln.ops.gemm import cpu_kquants_a8 as kquants
from kiln.ops.gemm.prepared_linear.spec import prepared_linear_reference
from kiln.ops.gemm.weight_formats import prepare_linear_weight, prepared_matrix
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFStackedWeight, GGUFWeight
from kiln.verify import assert_close
from tests.ops.gemm.kquant_weights import gguf_matrix, random_part
from tests.ops.gemm.native_gemv_child import assert_compiled_call_holds_native_op

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")
TYPES = ("Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def native():
    if not kquants.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


def _gguf_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's rounding of x float32 [M, K] per 256 values: (int8 values [M, K], float32 d [M, K / 256]
    = max|x| / 127)."""
    m, k = x.shape
    blocks = x.view(-1, 256)
    data = gguf.quants.Q8_0.quantize_blocks(blocks.numpy())
    q = torch.from_numpy(data[:, 2:].copy().view(np.int8)).view(m, k)
    return q, (blocks.abs().amax(-1) / 127).view(m, k // 256)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "tensor_form"])
def test_quantize_q8_k_gives_gguf_rounding_per_256_and_the_sums(use_native, monkeypatch):
    if use_native and not kquants.load():
        pytest.skip("no native library here")
    if not use_native:
        monkeypatch.setitem(kquants._state, "loaded", False)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = torch.randn(5, 768, generator=g) * torch.rand(5, 1, generator=g) * 4
    x[0, :256] = torch.arange(256) * 0.125 - 15.875  # amax 15.875: many x / d land on halves (ties)
    x[1, 256:512] = 0.0  # an all-zero block: d = 0, q = 0
    q, d, sums = kquants.quantize_q8_k(x)
    gq, gd = _gguf_q8_k(x)
    assert q.dtype == torch.int8 and torch.equal(q, gq)
    assert d.dtype == torch.float32 and torch.equal(d, gd)
    assert sums.dtype == torch.int16 and torch.equal(sums, q.view(5, 48, 16).sum(-1).to(torch.int16))
    x[2, 300], x[3, 5] = float("nan"), float("-inf")
    q, d, _ = kquants.quantize_q8_k(x)
    assert torch.isnan(d[2, 1]) and torch.isnan(d[3, 0]) and not q[2, 256:512].any()
    assert torch.isfinite(d[2, [0, 2]]).all() and torch.isfinite(d[3, 1:]).all()


# sources: a plain weight of each type, and stacked projections mixing them (a Q4_K_M file's QKV)
SOURCES = [
    ("Q4_K",), ("Q5_K",), ("Q6_K",), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q5_K"), ("Q5_K", "Q4_K", "Q6_K")
]  # fmt: skip


@pytest.mark.parametrize("qtypes", SOURCES, ids="+".join)
def test_kquants_a8_gemv_is_w_times_the_gguf_quantized_x(qtypes, native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    k = random.choice((256, 768, 2816))  # whole super-blocks; 2816: a Llama intermediate size
    # rows past the kernel's 16-row tasks and parts' edges inside one task; a plain weight at least 15
    # rows: ||out - ref|| / ||ref|| over one output that cancels can exceed any fixed bound (150 seeds
    # per type at 15-40 rows: at most 8e-7)
    sizes = (1, 15, 17, 40) if len(qtypes) > 1 else (15, 17, 40)
    parts = [random_part(q, random.choice(sizes), k, g) for q in qtypes]
    blocks, table = kquants.pack(GGUFStackedWeight.stack(parts) if len(parts) > 1 else parts[0])
    assert table.tolist() == [[kquants.QTYPE_IDS[p.qtype], p.shape[0]] for p in parts]
    matrix = torch.cat([gguf_matrix(p).double() for p in parts])
    assert torch.equal(kquants.matrix(blocks, table, k).double(), matrix)
    n = matrix.shape[0]
    x = torch.randn(1, k, generator=g) * 3
    q, d = _gguf_q8_k(x)
    x_gguf = (q.view(1, -1, 256).double() * d.view(1, -1, 1).double()).view(1, k)
    y = torch.full((1, n), float("nan"))
    y.copy_(kquants.kquants_a8_gemv(x, blocks, table, n))
    # integer sums per super-block: only the float32 scaling and accumulation round
    assert_close(y, x_gguf @ matrix.T, 2e-6, "W @ x'")
    error = (y.double() - x.double() @ matrix.T).norm() / (x.double() @ matrix.T).norm()
    assert 1e-4 < error < 3e-2, f"x's rounding per 256 values moves it a little: {error}"
    monkeypatch.setitem(kquants._state, "loaded", False)  # where the library cannot be built
    assert_close(kquants.kquants_a8_gemv(x, blocks, table, n), x_gguf @ matrix.T, 2e-6, "tensor form")
    monkeypatch.undo()
    x[0, k - 3] = float("nan")  # one NaN input poisons every output
    assert torch.isnan(kquants.kquants_a8_gemv(x, blocks, table, n)).all()


def test_the_offsets_and_mins_count(native):
    """Q4_K / Q5_K's mins and Q6_K's -32 enter through x's block sums: a kernel that dropped them would
    be far off. An x with a large common offset makes those terms dominate (and cancel against the
    scaled sums: float32 rounding of the two large terms, hence 1e-5 here rather than 1e-6)."""
    g = torch.Generator().manual_seed(7)
    for qtype in TYPES:
        weight = random_part(qtype, 33, 512, g)
        blocks, table = kquants.pack(weight)
        x = torch.randn(1, 512, generator=g) + 5.0
        y = kquants.kquants_a8_gemv(x, blocks, table, 33)
        q, d = _gguf_q8_k(x)
        x_gguf = (q.view(1, -1, 256).double() * d.view(1, -1, 1).double()).view(1, 512)
        matrix = gguf_matrix(weight).double()
        ref = x_gguf @ matrix.T
        assert_close(y, ref, 1e-5, qtype)
        # the offset's share: x' minus its mean per 256 gives a result off by far more than that
        centered = x_gguf - x_gguf.view(1, -1, 256).mean(-1, keepdim=True).expand(1, -1, 256).reshape(1, -1)
        assert (centered @ matrix.T - ref).norm() > 0.1 * ref.norm()


def _x_q8_k(x: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] through gguf's rounding per 256 values, float64."""
    q, d = _gguf_q8_k(x)
    m, k = x.shape
    return (q.view(m, -1, 256).double() * d.view(m, -1, 1).double()).view(m, k)


@pytest.mark.parametrize(
    "qtypes", [("Q4_K",), ("Q6_K",), ("Q5_K",), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q5_K")], ids="+".join
)
def test_kquants_a8_gemm_rows_equal_the_one_row_kernel_bit_for_bit(qtypes, native, monkeypatch):
    """Batch invariance: each row of a several-row call (groups of 8 or 4 rows against each weight row,
    and a last partial group) is the one-row kernel's result for that row alone, to the bit, and W @ x'
    per row."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    k = random.choice((256, 768))
    parts = [random_part(q, random.choice((9, 17, 33)), k, g) for q in qtypes]
    blocks, table = kquants.pack(GGUFStackedWeight.stack(parts) if len(parts) > 1 else parts[0])
    n = int(table[:, 1].sum())
    x = torch.randn(19, k, generator=g) * torch.rand(19, 1, generator=g) * 4
    alone = torch.cat([kquants.kquants_a8_gemv(x[i : i + 1], blocks, table, n) for i in range(19)])
    for m in (1, 2, 3, 4, 5, 8, 9, 12, 19):
        y = torch.full((m, n), float("nan"))
        y.copy_(kquants.kquants_a8_gemm(x[:m], blocks, table, n))
        assert torch.equal(y, alone[:m]), f"{m} rows"
    matrix = torch.cat([gguf_matrix(p).double() for p in parts])
    assert_close(alone, _x_q8_k(x) @ matrix.T, 2e-6, "W @ x' per row")
    monkeypatch.setitem(kquants._state, "loaded", False)  # the tensor form: the same values, other sums
    assert_close(kquants.kquants_a8_gemm(x, blocks, table, n), _x_q8_k(x) @ matrix.T, 2e-6, "tensor form")
    monkeypatch.undo()
    x[7, 3] = float("nan")  # a NaN poisons its own row only
    y = kquants.kquants_a8_gemm(x, blocks, table, n)
    assert torch.isnan(y[7]).all() and torch.equal(y[:7], alone[:7]) and torch.equal(y[8:], alone[8:])


def test_kquants_a8_gemm_on_amx_tiles_equals_the_one_row_kernel_bit_for_bit(native):
    """Hosts with AMX-INT8 run each part's whole 16-row blocks of weights on tiles from 12 rows of x
    (cpu_kquants_a8_amx.cpp): every output still the one-row kernel's for its row alone, to the bit, over
    x in several 16-row tile blocks (the last one short), parts of each type whose edges fall inside
    blocks, and rows past a part's last whole block (the row kernels)."""
    if not torch.ops.kiln_cpu.amx_int8_available():
        pytest.skip("this CPU has no AMX-INT8 tiles: the row kernels' own test above covers it")
    g = torch.Generator().manual_seed(random.randrange(2**31))
    k = random.choice((512, 2816))
    parts = [random_part(q, n, k, g) for q, n in (("Q4_K", 35), ("Q6_K", 32), ("Q5_K", 21), ("Q4_K", 16))]
    blocks, table = kquants.pack(GGUFStackedWeight.stack(parts))
    n = int(table[:, 1].sum())
    x = torch.randn(37, k, generator=g) * torch.rand(37, 1, generator=g) * 4
    alone = torch.cat([kquants.kquants_a8_gemv(x[i : i + 1], blocks, table, n) for i in range(37)])
    for m in (12, 16, 23, 37):
        y = torch.full((m, n), float("nan"))
        y.copy_(kquants.kquants_a8_gemm(x[:m], blocks, table, n))
        assert torch.equal(y, alone[:m]), f"{m} rows: {(y - alone[:m]).abs().max()}"
    matrix = torch.cat([gguf_matrix(p).double() for p in parts])
    assert_close(alone, _x_q8_k(x) @ matrix.T, 2e-6, "W @ x' per row")
    x[20, k - 1] = float("nan")  # a NaN poisons its own row only, in the second tile block
    y = kquants.kquants_a8_gemm(x, blocks, table, n)
    assert torch.isnan(y[20]).all() and torch.equal(y[:20], alone[:20]) and torch.equal(y[21:], alone[21:])


def test_the_a8_formats_keep_only_the_file_blocks_of_k_quant_weights(native):
    """The "kquants_a8" layout holds a K-quant weight's file blocks, its parts table and an empty
    [N, 0]: no second copy of the matrix (the Q8_0-x layouts keep float32 copies and tiles besides
    their blocks); a Q8_0 weight, or a stack with a Q8_0 part, keeps its Q8_0-x layout."""
    g = torch.Generator().manual_seed(11)
    q4k, q6k = random_part("Q4_K", 20, 256, g), random_part("Q6_K", 12, 256, g)
    q8 = GGUFWeight("Q8_0", quantize_blocks(torch.randn(12, 256, generator=g), "Q8_0"), (12, 256))
    for fmt in ("q4_blocks_a8", "q8_blocks_a8"):
        for weight, kept in ((q4k, (q4k,)), (q6k, (q6k,)), (GGUFStackedWeight.stack([q4k, q6k]), (q4k, q6k))):
            prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
            assert prepared.layout == "kquants_a8" and prepared.kind == "gguf"
            blocks, table, width = prepared.tensors
            assert torch.equal(blocks, torch.cat([p.data.reshape(-1) for p in kept]))
            assert table.tolist() == [[kquants.QTYPE_IDS[p.qtype], p.shape[0]] for p in kept]
            assert width.shape == (weight.shape[0], 0)
            assert sum(t.nbytes for t in prepared.tensors) == blocks.nbytes + table.nbytes
            assert torch.equal(
                prepared_matrix(prepared.layout, prepared.tensors), weight.dequantize(torch.float64)
            )
        for weight in (q8, GGUFStackedWeight.stack([q4k, q8])):
            prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
            assert prepared.layout != "kquants_a8"
    exact = prepare_linear_weight(q4k, device=CPU, dtype=torch.float32, cpu_format="q4_blocks")
    assert exact.layout == "q4_blocks_onednn" or exact.layout == "onednn"  # the exact formats: unchanged


def test_prepared_linear_quantizes_every_row_to_q8_k_as_the_reference_does(native):
    g = torch.Generator().manual_seed(13)
    weight = GGUFStackedWeight.stack([random_part("Q4_K", 24, 512, g), random_part("Q6_K", 8, 512, g)])
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks_a8")
    assert prepared.layout == "kquants_a8"
    matrix = weight.dequantize(torch.float64)
    bias = torch.randn(32, generator=g)
    for m in (1, 3, 70):  # one decode row, a small batch, a prefill chunk
        x = torch.randn(m, 512, generator=g)
        y = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, bias)
        assert_close(y, _x_q8_k(x) @ matrix.T + bias.double(), 1e-6, f"{m} rows: Q8_K")
        reference = prepared_linear_reference(x, prepared.layout, prepared.tensors, bias, torch.float64)
        assert_close(y, reference, 1e-6, f"{m} rows: the verifier's reference")
        first = kiln.ops.prepared_linear(x[:1], prepared.layout, prepared.tensors, bias)
        assert torch.equal(y[:1], first), "a row's outputs do not depend on the rows beside it"
    for dtype in (torch.bfloat16, torch.float16):  # x read as float32, the result in x's dtype
        x = torch.randn(5, 512, generator=g).to(dtype)
        y = kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, bias)
        assert y.dtype == dtype
        assert_close(y, _x_q8_k(x.float()) @ matrix.T + bias.double(), 1e-2, f"{dtype} rows")


def test_malformed_k_quant_inputs_are_named(native):
    g = torch.Generator().manual_seed(17)
    weight = random_part("Q4_K", 20, 512, g)
    blocks, table = kquants.pack(weight)
    x, ops = torch.randn(1, 512, generator=g), torch.ops.kiln_cpu
    with pytest.raises(RuntimeError, match=r"part 0 has GGML type 8; the kernel takes Q4_K \(12\)"):
        ops.kquants_a8_gemv(x, blocks, torch.tensor([[8, 20]]), 20)
    with pytest.raises(RuntimeError, match=r"blocks must be uint8 \[5760\] on the CPU"):
        ops.kquants_a8_gemv(x, blocks[:-1], table, 20)
    with pytest.raises(RuntimeError, match=r"n = 21 but the parts hold 20 rows"):
        ops.kquants_a8_gemv(x, blocks, table, 21)
    with pytest.raises(RuntimeError, match=r"K = 320 must be a multiple of 256"):
        ops.kquants_a8_gemv(torch.randn(1, 320), blocks, table, 20)
    with pytest.raises(RuntimeError, match=r"parts must be int64 \[P, 2\]"):
        ops.kquants_a8_gemv(x, blocks, table.int(), 20)
    with pytest.raises(ValueError, match=r"kquants_a8_gemv: x must be \[1, K\]"):
        kquants.kquants_a8_gemv(torch.randn(2, 512), blocks, table, 20)
    with pytest.raises(RuntimeError, match=r"kquants_a8_gemm: x must be float32 \[M, K\], got Double"):
        ops.kquants_a8_gemm(torch.randn(3, 512).double(), blocks, table, 20)
    with pytest.raises(RuntimeError, match=r"kquants_a8_gemm: blocks must be uint8 \[5760\]"):
        ops.kquants_a8_gemm(torch.randn(3, 512), blocks[:-1], table, 20)
    with pytest.raises(ValueError, match=r"kquants_a8_gemm: x must be \[M, K\] with K a multiple of 256"):
        kquants.kquants_a8_gemm(torch.randn(3, 500), blocks, table, 20)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q4_blocks_a8")
    blocks, table, width = prepared.tensors
    run = kiln.ops.prepared_linear
    with pytest.raises(
        ValueError, match=r"K-quant blocks of 5759 bytes in parts of 20 rows, expected a multiple of 2880"
    ):
        run(x, prepared.layout, [blocks[:-1], table, width])
    with pytest.raises(ValueError, match=r"K-quant parts \[\[8, 20\]\]"):
        run(x, prepared.layout, [blocks, torch.tensor([[8, 20]]), width])
    with pytest.raises(ValueError, match=r"parts hold 20 rows, weight\[2\] is \[21, 0\], expected \[20, 0\]"):
        run(x, prepared.layout, [blocks, table, torch.empty(21, 0, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"x has 576 in-features, the 'kquants_a8' weight 512"):
        run(torch.randn(2, 576), prepared.layout, [blocks, table, width])
    with pytest.raises(ValueError, match=r"layout 'kquants_a8' holds 3 tensors, got 2"):
        run(x, prepared.layout, [blocks, table])


def test_a_compiled_step_traced_before_any_eager_call_holds_the_kquants_op(native):
    setup = """
from kiln.ops.gemm import cpu_kquants_a8
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight
weight = GGUFWeight("Q4_K", quantize_blocks(torch.randn(48, 256) * 0.1, "Q4_K"), (48, 256))
"""
    assert_compiled_call_holds_native_op(setup, "q4_blocks_a8", "cpu_kquants_a8._quantize_tensor")
