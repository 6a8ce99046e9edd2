"""kiln.ops.gemm.cpu_blocks_panel: the exact blocks layouts' many-row kernel (prefill, large batches) on
the blocks themselves, so those layouts keep no float32 copy. The references not written by Kiln:
`gguf` writes the non-K blocks and decodes every type (Kiln's packer writes the K-quant blocks, which
gguf cannot); the products are checked against float64."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_blocks_panel, cpu_q4_blocks, cpu_q8_blocks, weight_formats
from kiln.ops.gemm.cpu_blocks_panel import block_matrix, blocks_panel_gemm
from kiln.ops.gemm.prepared_linear import PREPARED_LINEAR
from kiln.ops.gemm.weight_formats import prepare_linear_weight, prepared_matrix
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFStackedWeight, GGUFWeight
from kiln.verify import assert_close

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")
# GGUF type -> (cpu format, the layout it gets, tensors before the float32 copy)
CASES = {
    "Q4_0": ("q4_blocks", "q4_blocks_onednn", 3),
    "Q4_1": ("q4_blocks", "q4_blocks_onednn", 3),
    "Q4_K": ("q4_blocks", "q4_blocks_onednn", 3),
    "Q8_0": ("q8_blocks", "q8_blocks_onednn", 2),
    "Q5_0": ("q8_blocks", "q8_blocks_onednn", 2),
    "Q6_K": ("q8_blocks", "q8_blocks_onednn", 2),  # a scale per 16
    "Q5_K": ("q8_blocks", "q8_blocks_mins_onednn", 3),  # values, scales and mins
}


@pytest.fixture(scope="module")
def native():
    if not cpu_blocks_panel.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


@pytest.fixture(scope="module")
def panel_layouts(native):
    if not native_cpu.blocks_panel_runs():
        pytest.skip("the layouts keep their float32 copy here (a scalar build, or KILN_CPU_BLOCKS_PANEL=0)")


def _weight(qtype: str, n: int, k: int, g) -> tuple[GGUFWeight, torch.Tensor]:
    """(GGUFWeight of fresh values, rows at their own scales and offsets; gguf's float64 decode)."""
    values = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    values += 0.3 * torch.randn(n, 1, generator=g)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype.endswith("_K"):
        blocks = quantize_blocks(values, qtype)
    else:
        blocks = torch.from_numpy(gguf.quants.quantize(values.numpy(), kind))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind)).double().view(n, k)
    return GGUFWeight(qtype, blocks, (n, k)), expected


def _blocks(qtype: str, weight: GGUFWeight) -> tuple[torch.Tensor, ...]:
    if qtype in ("Q4_0", "Q4_1", "Q4_K"):
        return cpu_q4_blocks.pack(weight)
    if qtype == "Q5_K":
        return cpu_q8_blocks.pack_with_mins(weight)
    return cpu_q8_blocks.pack(weight)


@pytest.mark.parametrize("qtype", list(CASES))
def test_panel_kernel_is_the_exact_matrix_product_and_each_row_its_own(qtype, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    # N past several 14-row panels with a tail; K = 8 blocks of 32 (one super-block for the K-quants)
    n, k = 45, 512 if qtype.endswith("_K") else 160
    weight, expected = _weight(qtype, n, k, g)
    blocks = _blocks(qtype, weight)
    assert torch.equal(block_matrix(*blocks if len(blocks) == 3 else (*blocks, None)).double(), expected)
    x = torch.randn(70, k, generator=g)  # 70 rows: chunks of 32 (AVX-512) or 16 (AVX2) with a tail
    y = blocks_panel_gemm(x, *blocks)
    assert y.dtype == torch.float32 and y.shape == (70, n)
    assert_close(y, x.double() @ expected.T, 1e-6, f"{qtype}, 70 rows")
    for m in (1, 5, 16, 17, 33):  # each row's outputs are those it gets in any other call
        assert torch.equal(blocks_panel_gemm(x[:m], *blocks), y[:m]), f"{qtype}, {m} rows"
    assert torch.equal(blocks_panel_gemm(x[40:41], *blocks), y[40:41])
    # bf16 x is read as float32
    x16 = x[:20].to(torch.bfloat16)
    assert torch.equal(blocks_panel_gemm(x16, *blocks), blocks_panel_gemm(x16.float(), *blocks))


@pytest.mark.parametrize("n", [1, 13, 14, 15, 29])
def test_panel_kernel_covers_every_tail_of_rows(n, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weight, expected = _weight("Q4_1", n, 96, g)
    x = torch.randn(35, 96, generator=g)
    y = torch.full((35, n), float("nan"))
    y.copy_(blocks_panel_gemm(x, *cpu_q4_blocks.pack(weight)))
    assert_close(y, x.double() @ expected.T, 1e-6, f"N = {n}")


def test_panel_kernel_takes_a_stacked_weights_scales_and_mins_per_16(native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    parts = [_weight(q, n, 256, g) for q, n in (("Q4_K", 20), ("Q6_K", 9))]
    stacked = GGUFStackedWeight.stack([w for w, _ in parts])
    values, scales, mins = stacked.fields()
    assert scales.shape[1] == 256 // 16 and mins is not None
    x = torch.randn(40, 256, generator=g)
    expected = torch.cat([e for _, e in parts])
    assert_close(blocks_panel_gemm(x, values, scales, mins), x.double() @ expected.T, 1e-6, "stacked")


def test_a_nan_in_x_stays_in_its_row(native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weight, _ = _weight("Q8_0", 30, 64, g)
    blocks = cpu_q8_blocks.pack(weight)
    x = torch.randn(40, 64, generator=g)
    x[7, 3] = float("nan")
    y = blocks_panel_gemm(x, *blocks)
    assert y[7].isnan().all() and not y[torch.arange(40) != 7].isnan().any()


def test_the_tensor_form_is_the_same_product(native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weight, _ = _weight("Q4_K", 33, 256, g)
    blocks = cpu_q4_blocks.pack(weight)
    x = torch.randn(50, 256, generator=g)
    native_y = blocks_panel_gemm(x, *blocks)
    monkeypatch.setitem(cpu_blocks_panel._state, "loaded", False)
    assert_close(blocks_panel_gemm(x, *blocks), native_y.double(), 1e-6, "tensor form")


def test_malformed_inputs_are_named(native):
    nibbles, scales, mins = torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 3), torch.zeros(4, 3)
    op = torch.ops.kiln_cpu.blocks_panel_gemm
    with pytest.raises(RuntimeError, match="x must be float32"):
        op(torch.ones(2, 96, dtype=torch.float64), nibbles, scales, mins)
    with pytest.raises(RuntimeError, match="K = 80 must be a positive multiple of 32"):
        op(torch.ones(2, 80), nibbles, scales, mins)
    with pytest.raises(RuntimeError, match="values must be uint8 Q4 nibbles"):
        op(torch.ones(2, 64), nibbles, scales, mins)  # nibbles for K = 96
    with pytest.raises(RuntimeError, match="values must be uint8 Q4 nibbles"):
        op(torch.ones(2, 96), nibbles.float(), scales, mins)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        op(torch.ones(2, 96), nibbles, torch.ones(4, 6), mins)  # per 16: Q8 values only
    with pytest.raises(RuntimeError, match="Q4 nibbles need their mins"):
        op(torch.ones(2, 96), nibbles, scales, None)
    with pytest.raises(RuntimeError, match="mins must be float32 shaped as the scales"):
        op(torch.ones(2, 96), nibbles, scales, torch.zeros(4, 2))
    assert op(torch.ones(0, 96), nibbles, scales, mins).shape == (0, 4)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "Q5_K"])
def test_the_exact_layouts_keep_no_float32_copy_and_run_many_rows_on_the_blocks(qtype, panel_layouts):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    fmt, layout, at = CASES[qtype]
    n, k = 40, 256
    weight, expected = _weight(qtype, n, k, g)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
    assert prepared.layout == layout and prepared.tensors[at].numel() == 0
    # what it holds: the blocks (and tiles), ~1-2 bytes a weight, not the 4 of a float32 copy
    assert sum(t.nbytes for t in prepared.tensors) < 2.3 * n * k
    # the exact matrix, which gguf's float32 decode rounds once (Q5_K: q * (d * sc) + min)
    assert torch.equal(prepared_matrix(layout, prepared.tensors).float().double(), expected)
    rows = native_cpu.blocks_gemm_rows() + native_cpu.blocks_tiles_rows("q4")[1] + 7  # past the others
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    y = torch.full((rows, n), float("nan"))
    y.copy_(kiln.ops.prepared_linear(x, layout, prepared.tensors, bias))
    assert_close(y, x.double() @ expected.T + bias.double(), 1e-6, f"{qtype}, {rows} rows")
    blocks = prepared.tensors[:at]
    assert torch.equal(y, blocks_panel_gemm(x, *blocks) + bias)
    # the byte model behind `kiln bench`'s GB/s counts the blocks these rows read
    shape = {"M": rows, "N": n, "K": k, "format": fmt, "source": qtype}
    read = PREPARED_LINEAR.bytes(shape, torch.float32) - (rows * k + rows * n) * 4
    assert read == pytest.approx(sum(t.nbytes for t in blocks))


def test_a_compiled_call_holds_the_panel_op(panel_layouts, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weight, expected = _weight("Q8_0", 24, 96, g)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format="q8_blocks")

    def refuse(*args):
        raise AssertionError("the compiled graph traced the tensor form, not the native op")

    monkeypatch.setattr(cpu_blocks_panel, "block_matrix", refuse)
    step = torch.compile(
        lambda x: kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, None, None), fullgraph=True
    )
    x = torch.randn(100, 96, generator=g)
    assert torch.equal(step(x), blocks_panel_gemm(x, *prepared.tensors[:2]))


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_1"])
def test_a_large_weight_is_unpacked_a_chunk_of_rows_at_a_time_into_the_same_tensors(qtype, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weight, _ = _weight(qtype, 75, 256, g)
    fmt = CASES[qtype][0]
    whole = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
    row_bytes = weight.data.view(75, -1).shape[1]
    monkeypatch.setattr(weight_formats, "PACK_CHUNK_BYTES", 16 * row_bytes + 5)  # 16 rows a chunk, 5 last
    calls = []
    layout, qtypes, pack = weight_formats.BLOCKS_FORMATS[fmt]
    monkeypatch.setitem(weight_formats.BLOCKS_FORMATS, fmt, (layout, qtypes, _counting(pack, calls)))
    chunked = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
    assert calls == [16, 16, 16, 16, 11] and chunked.layout == whole.layout
    for a, b in zip(whole.tensors, chunked.tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.layout == torch.strided:  # (oneDNN's packed copy, where one is kept, has no plain data)
            assert torch.equal(a, b)


def _counting(pack, calls: list):
    """`pack`, recording the rows of each weight it is given."""

    def run(weight):
        calls.append(weight.shape[0])
        return pack(weight)

    return run
