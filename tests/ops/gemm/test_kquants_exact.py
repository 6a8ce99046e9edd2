"""kiln.ops.gemm.cpu_kquants: GGUF Q4_K / Q5_K / Q6_K blocks as the file stores them times x in exact
float32 (the row kernel `kquants_gemm` and the panel kernel `kquants_panel_gemm`). References not
written by Kiln: `gguf` decodes the weights' blocks (Kiln's packer writes the K-quant blocks, which
gguf cannot); the panel kernel's decode is also checked bit for bit against the float32 weights the
exact blocks layouts' panel kernel uses for the same matrices."""

import random

import pytest
import torch

from kiln.ops.gemm import cpu_blocks_panel, cpu_kquants_a8, cpu_q4_blocks, cpu_q8_blocks
from kiln.ops.gemm import cpu_kquants as kquants
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFStackedWeight, GGUFWeight
from kiln.verify import assert_close
from tests.ops.gemm.kquant_weights import gguf_matrix, random_part

gguf = pytest.importorskip("gguf")
# plain weights of each type, and stacked projections mixing them (a Q4_K_M file's QKV)
SOURCES = [("Q4_K",), ("Q5_K",), ("Q6_K",), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q5_K")]
OPS = ("kquants_gemm", "kquants_panel_gemm")


@pytest.fixture(scope="module")
def native():
    if not kquants.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


def _weight(qtypes, k, g, sizes=(9, 17, 33)):
    parts = [random_part(q, random.choice(sizes), k, g) for q in qtypes]
    weight = GGUFStackedWeight.stack(parts) if len(parts) > 1 else parts[0]
    blocks, table = cpu_kquants_a8.pack(weight)
    return parts, blocks, table, torch.cat([gguf_matrix(p) for p in parts])


@pytest.mark.parametrize("qtypes", SOURCES, ids="+".join)
@pytest.mark.parametrize("op", OPS)
def test_product_is_the_gguf_matrix_times_x_and_each_row_as_alone(op, qtypes, native, monkeypatch):
    """Within 2e-6 of the float64 product with gguf's weights (K-term float32 sums: ~sqrt(K) * 6e-8
    at these K), for row counts inside one pass of the row kernel (4 x rows), past it, on its tiles
    (from TILE_MIN_ROWS rows, 10 a pass) and past the panel's 32-row chunks; each row of a call bit for
    bit what it gets beside one other row below TILE_MIN_ROWS, beside TILE_MIN_ROWS - 1 others from there
    on (batch invariance within each range; the one-row path sums in its own order, the panel's is the
    same for every row count), with the output poisoned first."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    k = random.choice((256, 768, 2816))  # whole super-blocks; 2816: a Llama intermediate size
    parts, blocks, table, matrix = _weight(qtypes, k, g)
    n = matrix.shape[0]
    x = torch.randn(41, k, generator=g) * torch.rand(41, 1, generator=g) * 3
    fn = getattr(kquants, op)
    ref = x.double() @ matrix.double().T
    alone = torch.cat([fn(x[i : i + 1], blocks, table, n) for i in range(41)])
    assert_close(alone, ref, 2e-6, f"{op}: W @ x, one row a call")
    paired = torch.cat([fn(x[[i, (i + 7) % 41]], blocks, table, n)[:1] for i in range(41)])
    assert_close(paired, ref, 2e-6, f"{op}: W @ x, two rows a call")
    tiled = kquants.TILE_MIN_ROWS
    others = [[i, *((i + 7 * j) % 41 for j in range(1, tiled))] for i in range(41)]
    grouped = torch.cat([fn(x[rows], blocks, table, n)[:1] for rows in others])
    assert_close(grouped, ref, 2e-6, f"{op}: W @ x, {tiled} rows a call")
    if op == "kquants_panel_gemm":
        assert torch.equal(paired, alone) and torch.equal(grouped, alone)
    for m in (3, 4, 5, 6, 8, 11, 33, 41):
        y = torch.full((m, n), float("nan"))
        y.copy_(fn(x[:m], blocks, table, n))
        expected = paired if m < tiled else grouped
        assert torch.equal(y, expected[:m]), f"{op}, {m} rows: a row's outputs depend on the others"
    monkeypatch.setitem(kquants._state, "loaded", False)  # where the library cannot be built
    assert_close(fn(x[:5], blocks, table, n), ref[:5], 2e-6, "tensor form")


@pytest.mark.parametrize("qtype", ("Q4_K", "Q5_K", "Q6_K"))
def test_weights_are_ggufs_float32_values_bit_for_bit(qtype, native):
    """x = the identity reads each weight back once (w * 1 summed with zeros): the decode of the panel
    kernel and of the row kernel (its tiles, rows 0-15 of 29, transposed on the fly with their scales;
    its per-row path: rows 16-28, and every row with 3 x rows; its one-row kernel) is gguf's float32
    decode exactly; and the panel's products equal, bit for bit, those of the exact blocks layouts'
    panel kernel on the same matrix (values re-packed: Q4 nibbles with d, m per 32; int8 with a scale
    per 16; int8 with scale and min per 32): the same float32 weights, the same sums."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    k = 512
    weight = random_part(qtype, 29, k, g)
    blocks, table = cpu_kquants_a8.pack(weight)
    eye = torch.eye(k)
    assert torch.equal(kquants.kquants_panel_gemm(eye, blocks, table, 29).T, gguf_matrix(weight))
    assert torch.equal(kquants.kquants_gemm(eye, blocks, table, 29).T, gguf_matrix(weight))
    assert torch.equal(
        kquants.kquants_gemm(eye[200:203], blocks, table, 29).T, gguf_matrix(weight)[:, 200:203]
    )
    for i in (0, 77, 300, 511):  # the one-row kernel (Q4_K / Q5_K factored: d sc_j q - dmin m_j)
        one = kquants.kquants_gemm(eye[i : i + 1], blocks, table, 29)[0]
        assert torch.equal(one, gguf_matrix(weight)[:, i])
    if qtype == "Q4_K":
        fields = cpu_q4_blocks.pack(weight)
    elif qtype == "Q6_K":
        fields = (*cpu_q8_blocks.pack(weight), None)
    else:
        fields = cpu_q8_blocks.pack_with_mins(weight)
    x = torch.randn(37, k, generator=g)
    assert torch.equal(
        kquants.kquants_panel_gemm(x, blocks, table, 29), cpu_blocks_panel.blocks_panel_gemm(x, *fields)
    )


def test_row_kernel_takes_whole_groups_of_rows_as_tiles_whatever_the_threads(native):
    """From TILE_MIN_ROWS x rows AVX-512 builds run each group of 16 output rows (counted from row 0)
    that lies in one part as a tile (Q4_K, Q5_K, Q6_K), the rest row by row: a part boundary inside a
    group, a group cut short by the end and the split of the groups between threads change no output
    bit, and every output is within 2e-6 of gguf's product. Rows 0-19 Q6_K (group 0-15 whole), 20-48
    Q4_K (group 32-47 whole; 16-31 spans two parts), 49-85 Q5_K (group 64-79 whole; 48-63 spans two
    parts, 80-85 ends early)."""
    g = torch.Generator().manual_seed(11)
    parts = [random_part(q, rows, 768, g) for q, rows in (("Q6_K", 20), ("Q4_K", 29), ("Q5_K", 37))]
    blocks, table = cpu_kquants_a8.pack(GGUFStackedWeight.stack(parts))
    ref = torch.cat([gguf_matrix(p) for p in parts]).double()
    x = torch.randn(kquants.TILE_MIN_ROWS + 2, 768, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(kquants.kquants_gemm(x, blocks, table, 86))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert_close(outs[0], x.double() @ ref.T, 2e-6, "kquants_gemm, tiles and rows")


def test_mins_and_offsets_count_and_nan_stays_in_its_row(native):
    """Q4_K / Q5_K's mins enter the row kernel through x's sums per 32: an x with a large common
    offset makes them dominate (a kernel without them is far off), still within float32 rounding of
    the two large terms; a NaN in one row of x poisons that row's outputs only."""
    g = torch.Generator().manual_seed(7)
    for qtype in ("Q4_K", "Q5_K", "Q6_K"):
        weight = random_part(qtype, 33, 512, g)
        blocks, table = cpu_kquants_a8.pack(weight)
        matrix = gguf_matrix(weight).double()
        x = torch.randn(6, 512, generator=g) + 5.0
        for op in OPS:
            fn = getattr(kquants, op)
            y = fn(x, blocks, table, 33)
            ref = x.double() @ matrix.T
            assert_close(y, ref, 1e-5, f"{qtype} {op}")
            centered = x.double() - x.double().mean(-1, keepdim=True)
            assert (centered @ matrix.T - ref).norm() > 0.1 * ref.norm()
            poisoned = x.clone()
            poisoned[2, 300] = float("nan")
            y2 = fn(poisoned, blocks, table, 33)
            assert torch.isnan(y2[2]).all()
            assert torch.equal(y2[:2], y[:2]) and torch.equal(y2[3:], y[3:])


def test_kquants_matmul_routes_by_rows(native, monkeypatch):
    g = torch.Generator().manual_seed(3)
    _, blocks, table, _ = _weight(("Q4_K", "Q6_K"), 256, g)
    n = int(table[:, 1].sum())
    most = kquants.rows_kernel_max()
    for m in (1, most, most + 1, 40):
        x = torch.randn(m, 256, generator=g)
        expected = (kquants.kquants_gemm if m <= most else kquants.kquants_panel_gemm)(x, blocks, table, n)
        assert torch.equal(kquants.kquants_matmul(x, blocks, table, n), expected)


@pytest.mark.parametrize("op", OPS)
def test_malformed_inputs_are_named(op, native):
    g = torch.Generator().manual_seed(5)
    _, blocks, table, _ = _weight(("Q4_K",), 512, g, sizes=(16,))
    native_op = getattr(torch.ops.kiln_cpu, op)
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match=f"{op}: K = 500 must be a positive multiple of 256"):
        native_op(torch.randn(2, 500), blocks, table, 16)
    with pytest.raises(RuntimeError, match=f"{op}: x must be float32"):
        native_op(x.double(), blocks, table, 16)
    with pytest.raises(RuntimeError, match=f"{op}: n = 17 but the parts hold 16 rows"):
        native_op(x, blocks, table, 17)
    with pytest.raises(RuntimeError, match=f"{op}: blocks must be uint8"):
        native_op(x, blocks[:-1], table, 16)
    with pytest.raises(RuntimeError, match=f"{op}: part 0 has GGML type 8"):
        native_op(x, blocks, torch.tensor([[8, 16]]), 16)
    with pytest.raises(RuntimeError, match=f"{op}: parts must be int64"):
        native_op(x, blocks, table.int(), 16)
    with pytest.raises(ValueError, match=f"{op}: x must be a floating-point CPU tensor"):
        getattr(kquants, op)(torch.randn(2, 300), blocks, table, 16)


def test_a_compiled_call_holds_the_native_ops(native):
    """The fakes let torch.compile keep each op as one node (no graph break, the same result)."""
    g = torch.Generator().manual_seed(9)
    _, blocks, table, _ = _weight(("Q4_K", "Q6_K"), 256, g)
    n = int(table[:, 1].sum())
    x = torch.randn(3, 256, generator=g)
    for op in OPS:
        fn = getattr(kquants, op)
        compiled = torch.compile(
            lambda t, fn=fn: fn(t, blocks, table, n) * 2.0, backend="eager", fullgraph=True
        )
        assert torch.equal(compiled(x), fn(x, blocks, table, n) * 2.0)


def test_the_kquants_format_keeps_the_file_blocks_and_runs_the_exact_kernels(native):
    """cpu_format "kquants": a K-quant weight (plain or stacked of K-quant parts) keeps its file's blocks
    and nothing else ("kquants"), prepared_linear (with a bias) is the float64 product with gguf's
    matrix at one row, the row kernel's rows and the panel's; other weights take the exact blocks
    layouts ("q4_blocks"'s)."""
    from kiln import ops
    from kiln.ops.gemm.weight_formats import kquants_layout_runs, prepare_linear_weight

    if not kquants_layout_runs():
        pytest.skip("no vector build of the native kernels here: the format keeps the exact layouts")
    g = torch.Generator().manual_seed(17)
    cpu = torch.device("cpu")
    q4k, q6k = random_part("Q4_K", 24, 512, g), random_part("Q6_K", 8, 512, g)
    stacked = GGUFStackedWeight.stack([q4k, q6k])
    prepared = prepare_linear_weight(stacked, device=cpu, dtype=torch.float32, cpu_format="kquants")
    assert prepared.layout == "kquants" and prepared.kind == "gguf"
    blocks, table, width = prepared.tensors
    assert torch.equal(blocks, torch.cat([q4k.data.reshape(-1), q6k.data.reshape(-1)]))
    assert width.shape == (32, 0) and sum(t.nbytes for t in prepared.tensors) == blocks.nbytes + table.nbytes
    matrix = torch.cat([gguf_matrix(q4k), gguf_matrix(q6k)]).double()
    bias = torch.randn(32, generator=g)
    for m in (1, 5, kquants.rows_kernel_max() + 3, 70):
        x = torch.randn(m, 512, generator=g)
        y = ops.prepared_linear(x, prepared.layout, prepared.tensors, bias, None)
        assert_close(y, x.double() @ matrix.T + bias.double(), 2e-6, f"{m} rows")
    q8 = GGUFWeight("Q8_0", quantize_blocks(torch.randn(8, 512, generator=g), "Q8_0"), (8, 512))
    q41 = GGUFWeight("Q4_1", quantize_blocks(torch.randn(8, 512, generator=g), "Q4_1"), (8, 512))
    for weight, exact in ((q41, "q4_blocks"), (GGUFStackedWeight.stack([q4k, q8]), "q4_blocks")):
        got = prepare_linear_weight(weight, device=cpu, dtype=torch.float32, cpu_format="kquants").layout
        assert got == prepare_linear_weight(weight, device=cpu, dtype=torch.float32, cpu_format=exact).layout
