"""The Q4 and Q8_0 blocks layouts' 16-row tile kernels (kiln.ops.gemm.cpu_block_tiles.q4_tiles_gemm,
q8_tiles_gemm): the tiles hold the GGUF blocks' exact values (`gguf` writes and dequantizes the
blocks), every output is a float32 sum of exact products within a float32 tolerance of float64, each
row's floats do not depend on the rows beside it, NaN stays in its row, and prepared_linear hands them
the rows native_cpu says. The kernels are built into every native library (vector or scalar), so the
op tests run on any host; the routing test follows this host's build."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops import native_cpu
from kiln.ops.gemm import cpu_block_tiles as tiles_module
from kiln.ops.gemm import cpu_q4_blocks, cpu_q8_blocks
from kiln.ops.gemm.prepared_linear import PREPARED_LINEAR
from kiln.ops.gemm.weight_formats import prepare_linear_weight, prepared_matrix
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight
from kiln.verify import assert_close
from tests.ops.gemm.blocks_copy import many_rows

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def native():
    if not tiles_module.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


def _weight(qtype: str, n: int, k: int, generator) -> tuple[GGUFWeight, torch.Tensor]:
    """(GGUFWeight, its float64 matrix as `gguf` dequantizes it): rows of unlike size, fresh values."""
    weight = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    if qtype == "Q4_K":  # gguf cannot quantize Q4_K: Kiln's packer writes it, gguf reads it back
        blocks = quantize_blocks(weight, qtype)
    else:
        blocks = torch.from_numpy(gguf.quants.quantize(weight.numpy(), kind))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind)).double()
    return GGUFWeight(qtype, blocks, (n, k)), expected


def _tiles(weight: GGUFWeight):
    """(tiles, tile scales) of a Q4 or Q8_0 weight, packed whatever this build runs."""
    if weight.qtype == "Q8_0":
        return tiles_module.pack_q8(*cpu_q8_blocks.pack(weight))
    return tiles_module.pack_q4(*cpu_q4_blocks.pack(weight))


def _gemm(qtype: str):
    return tiles_module.q8_tiles_gemm if qtype == "Q8_0" else tiles_module.q4_tiles_gemm


def _tile_matrix(qtype: str):
    return tiles_module.q8_tile_matrix if qtype == "Q8_0" else tiles_module.tile_matrix


@pytest.mark.parametrize(
    "qtype,n,k", [("Q4_0", 37, 96), ("Q4_1", 50, 160), ("Q4_K", 19, 512), ("Q8_0", 37, 96), ("Q8_0", 16, 64)]
)
def test_the_tiles_hold_the_blocks_exact_values(qtype, n, k, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    weight, expected = _weight(qtype, n, k, g)
    tiles, tile_scales = _tiles(weight)
    assert tiles.shape[0] == -(-n // 16)  # rows padded to whole tiles
    # Q4_0 / Q4_1's d and m are the file's float16 values; Q4_K's products of two scales are not
    assert tile_scales.dtype == (torch.float16 if qtype in ("Q4_0", "Q4_1") else torch.float32)
    matrix = _tile_matrix(qtype)(tiles, tile_scales, n)
    assert torch.equal(matrix.float().double(), expected)  # Q4: d * q + m, one float32 rounding; Q8_0: d * q
    padding = tile_scales.view(tiles.shape[0], -1, 16)[-1, :, n % 16 or 16 :]
    assert not padding.any()  # rows past N: zero scales
    if qtype == "Q8_0":  # and zero values
        assert not tiles.view(tiles.shape[0], k, 16)[-1, :, n % 16 or 16 :].any()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 17, 33])  # Q4 AVX-512: 8 x rows a pass; Q8_0: 16; AVX2: 6
def test_the_tile_kernel_matches_float64_row_by_row_and_its_tensor_form(qtype, m, native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 45, 544  # 17 blocks; 3 tiles, the last one 13 rows (a Q4 pass reads a missing second tile)
    weight, matrix = _weight(qtype, n, k, g)
    tiles, tile_scales = _tiles(weight)
    gemm = _gemm(qtype)
    x = torch.randn(m, k, generator=g)
    y = gemm(x, tiles, tile_scales, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_close(y, x.double() @ matrix.T, 1e-6, f"{qtype}, {m} rows")
    alone = torch.cat([gemm(x[i : i + 1], tiles, tile_scales, n) for i in range(m)])
    assert torch.equal(y, alone)  # each row's floats whatever shares the call
    if tile_scales.dtype == torch.float16:  # the same values as float32 scales: the same floats
        assert torch.equal(y, gemm(x, tiles, tile_scales.float(), n))
    monkeypatch.setitem(tiles_module._state, "loaded", False)  # as where the library cannot be built
    tensor_y = gemm(x, tiles, tile_scales, n)
    monkeypatch.undo()
    assert_close(y, tensor_y.double(), 1e-6, "against the tensor form")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_nan_in_one_row_of_x_stays_in_that_row(qtype, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 40, 96
    weight, _ = _weight(qtype, n, k, g)
    tiles, tile_scales = _tiles(weight)
    x = torch.randn(11, k, generator=g)
    clean = _gemm(qtype)(x, tiles, tile_scales, n)
    x[4, 50] = float("nan")
    y = _gemm(qtype)(x, tiles, tile_scales, n)
    assert torch.isnan(y[4]).all()
    others = torch.arange(11) != 4
    assert torch.equal(y[others], clean[others])


# per tile op: its GGUF type, the tiles' expected form and width (for [40, 160]), the scales' dtypes and
# width, and a wrong dtype for the tiles
_TILE_OPS = {
    "q4_tiles_gemm": ("Q4_1", r"uint8 \[ceil\(N / 16\), K / 32 \* 256\]", 1280, "float32 or float16", 160,
                      torch.int8),
    "q8_tiles_gemm": ("Q8_0", r"int8 \[ceil\(N / 16\), K \* 16\]", 2560, "float32", 80, torch.uint8),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_TILE_OPS))
def test_the_tile_ops_refuse_malformed_inputs_by_name(name, native):
    qtype, tiles_form, width, scales_dtypes, scales_width, wrong_dtype = _TILE_OPS[name]
    g = torch.Generator().manual_seed(5)
    weight, _ = _weight(qtype, 40, 160, g)
    tiles, tile_scales = _tiles(weight)
    op, x = getattr(torch.ops.kiln_cpu, name), torch.randn(3, 160)
    with pytest.raises(RuntimeError, match=rf"tiles must be {tiles_form} = \[3, {width}\]"):
        op(x, tiles[:, :-16].contiguous(), tile_scales, 40)
    with pytest.raises(RuntimeError, match=rf"tiles must be {tiles_form.split()[0]}"):
        op(x, tiles.view(wrong_dtype), tile_scales, 40)
    with pytest.raises(RuntimeError, match=rf"tile_scales must be {scales_dtypes} \[3, {scales_width}\]"):
        op(x, tiles, tile_scales[:, :-1].contiguous(), 40)
    with pytest.raises(RuntimeError, match=rf"tile_scales must be {scales_dtypes} .* got BFloat16"):
        op(x, tiles, tile_scales.bfloat16(), 40)
    for wrong_x in (x.double(), x.half()):
        with pytest.raises(RuntimeError, match=r"x must be float32 \[M, K\]"):
            op(wrong_x, tiles, tile_scales, 40)
    with pytest.raises(RuntimeError, match=r"K = 80 must be a multiple of 32"):
        op(torch.randn(3, 80), tiles, tile_scales, 40)
    with pytest.raises(RuntimeError, match=rf"= \[4, {width}\] for K = 160, N = 50"):
        op(x, tiles, tile_scales, 50)  # N past the tiles


@pytest.mark.parametrize(
    "fmt,qtype",
    [("q4_blocks", "Q4_1"), ("q4_blocks_a8", "Q4_1"), ("q8_blocks", "Q8_0"), ("q8_blocks_a8", "Q8_0")],
)
def test_prepared_linear_hands_the_tile_kernel_the_rows_this_build_gives_it(fmt, qtype, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    n, k = 45, 160
    weight, _ = _weight(qtype, n, k, g)
    prepared = prepare_linear_weight(weight, device=CPU, dtype=torch.float32, cpu_format=fmt)
    blocks = 2 if qtype == "Q8_0" else 3  # the tensors before the float32 copy
    tiles, tile_scales = prepared.tensors[blocks + 1 : blocks + 3]  # (the a8 layouts: then K-quant parts)
    first, last = native_cpu.blocks_tiles_rows(fmt[:2])
    if first == 0:  # no tile kernel in this build: the layout keeps no tiles
        assert tiles.numel() == 0 and tile_scales.numel() == 0
        return
    assert 1 < first <= native_cpu.blocks_gemm_rows() <= last
    matrix = prepared_matrix(prepared.layout, prepared.tensors)
    row_kernel = cpu_q8_blocks.q8_blocks_gemm if qtype == "Q8_0" else cpu_q4_blocks.q4_blocks_gemm
    copy = prepared.tensors[blocks]
    for m in (first - 1, first, last, last + 1):
        x = torch.randn(m, k, generator=g)
        y = torch.full((m, n), float("nan"))
        y.copy_(kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors))
        assert_close(y, x.double() @ matrix.T, 1e-6, f"{fmt}, {m} rows")
        if m > last:  # past the tiles: the panel kernel on the blocks, or the float32 copy through oneDNN
            assert torch.equal(y, many_rows(x, prepared.tensors, blocks))
            read = sum(t.nbytes for t in prepared.tensors[:blocks]) if copy.numel() == 0 else n * k * 4
        elif m >= first:
            assert torch.equal(y, _gemm(qtype)(x, tiles, tile_scales, n))
            read = (tiles.nbytes + tile_scales.nbytes) * n / (16 * tiles.shape[0])  # less the padding rows
        else:
            assert torch.equal(y, row_kernel(x, *prepared.tensors[:blocks]))
            read = sum(t.nbytes for t in prepared.tensors[:blocks])
        # the byte model behind `kiln bench`'s GB/s counts what that kernel reads
        shape = {"M": m, "N": n, "K": k, "format": fmt, "source": qtype}
        assert PREPARED_LINEAR.bytes(shape, torch.float32) - (m * k + m * n) * 4 == pytest.approx(read)
    broken = (*prepared.tensors[: blocks + 1], tiles[:, :-1].contiguous(), *prepared.tensors[blocks + 2 :])
    expected = 1279 if qtype != "Q8_0" else 2559
    with pytest.raises(ValueError, match=rf"{prepared.layout} tiles \(3, {expected}\) and tile scales"):
        kiln.ops.prepared_linear(torch.randn(first, k), prepared.layout, broken)
