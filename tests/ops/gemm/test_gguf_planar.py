"""GGUF weights in planes (kiln.ops.gemm.gguf_planar, prepared_linear's "gguf_planar_*" layouts on
CUDA): the packing is exact against the gguf package's own decode, and the Triton GEMM on the planes
(interpreted here, compiled on a GPU) matches the float64 product with the gguf package's matrix, for
every kernel type, decode and tiled row counts, split-K cuts inside K-quant super-blocks, K tiles
past the end of K, bias."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops.gemm.gguf_planar import PLANAR_LAYOUTS, pack_planar, planar_bytes, planar_matrix
from kiln.ops.gemm.gguf_planar_triton import gguf_planar_linear_triton
from kiln.quant.gguf_blocks import BLOCK_WEIGHTS, KERNEL_QTYPES, quantize_blocks
from kiln.verify import assert_close

gguf = pytest.importorskip("gguf")

SPLIT = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 4, "num_warps": 4,
         "num_stages": 2}  # fmt: skip


def seed() -> int:
    return random.randrange(2**31)


def blocks_and_matrix(n: int, k: int, qtype: str, generator: torch.Generator):
    """Fresh GGUF blocks uint8 [n, row_bytes] (uneven sub-block scales) and the gguf package's float32
    decode of them [n, k]."""
    weight = torch.randn(n, k, generator=generator) * (torch.arange(k) // 16 % 5 + 1)
    blocks = quantize_blocks(weight, qtype)
    matrix = gguf.quants.dequantize(blocks.numpy(), getattr(gguf.GGMLQuantizationType, qtype))
    return blocks, torch.from_numpy(matrix)


@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_planes_decode_bit_exact_with_the_gguf_package(qtype):
    k = 2 * BLOCK_WEIGHTS[qtype] + (0 if BLOCK_WEIGHTS[qtype] > 32 else 96)
    blocks, expected = blocks_and_matrix(23, k, qtype, torch.Generator().manual_seed(seed()))
    planes = pack_planar(blocks, qtype)
    assert torch.equal(planar_matrix(planes, qtype, torch.float32), expected)
    assert torch.equal(planar_matrix(planes, qtype, torch.float64), expected.double())
    assert sum(t.numel() * t.element_size() for t in planes) == planar_bytes(23, k, qtype)


def test_nibble_words_hold_weight_8j_plus_i_at_bits_4i():
    """A known answer: Q4_0 block of d = 1 whose weight t is t % 16 - 8, so quant t % 16: word 0 holds
    quants 0..7 (0x76543210), word 1 quants 8..15, word 2 quants 0..7 again (weights 16..23)."""
    nibbles = torch.tensor([(j % 16) | ((j + 16) % 16) << 4 for j in range(16)], dtype=torch.uint8)
    block = torch.cat([torch.tensor([1.0], dtype=torch.float16).view(torch.uint8), nibbles])[None]
    qs, qh, scales, mins, supers = pack_planar(block, "Q4_0")
    assert [w & 0xFFFFFFFF for w in qs[0].tolist()] == [0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98]
    assert scales.tolist() == [[1.0]] and scales.dtype == torch.float16
    assert qh.shape == mins.shape == supers.shape == (1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
@pytest.mark.parametrize(
    "M, N, blocks, config",
    [
        (1, 37, 2, None),  # decode: split-K by the heuristic
        (3, 19, 3, SPLIT),  # 4 splits of a 64-deep K tile: cuts inside a K-quant super-block
        (17, 21, 1, None),  # the tiled GEMM
    ],
)
def test_planar_gemm_matches_the_gguf_packages_matrix(qtype, dtype, M, N, blocks, config, device):
    generator = torch.Generator().manual_seed(seed())
    qk = BLOCK_WEIGHTS[qtype]
    k = blocks * qk + (96 if qk == 32 else 0)  # 32-block types: K tiles of 64 ending past K
    weight, matrix = blocks_and_matrix(N, k, qtype, generator)
    x = torch.randn(M, k, generator=generator).to(dtype)
    bias = torch.randn(N, generator=generator).to(dtype)
    planes = [t.to(device) for t in pack_planar(weight, qtype)]
    out = gguf_planar_linear_triton(x.to(device), planes, qtype, bias.to(device), config=config)
    assert out.dtype == dtype and out.shape == (M, N)
    ref = x.double() @ matrix.double().T + bias.double()
    assert_close(out.cpu(), ref, 1e-5 if dtype == torch.float32 else 2e-3)


def test_prepared_linear_refuses_planes_of_the_wrong_shape_or_dtype():
    blocks, _ = blocks_and_matrix(8, 256, "Q4_K", torch.Generator().manual_seed(0))
    planes = list(pack_planar(blocks, "Q4_K"))
    x = torch.randn(2, 256)
    wrong_scales = r"gguf_planar_Q4_K weight\[2\] \(scales\) has shape \(8, 4\), expected \(8, 8\)"
    with pytest.raises(ValueError, match=wrong_scales):
        kiln.ops.prepared_linear(x, "gguf_planar_Q4_K", [*planes[:2], planes[2][:, :4], *planes[3:]])
    wrong_supers = r"weight\[4\] \(supers\) has shape \(8, 1\), expected \(8, 2\)"
    with pytest.raises(ValueError, match=wrong_supers):
        kiln.ops.prepared_linear(x, "gguf_planar_Q4_K", [*planes[:4], planes[4][:, :1]])
    with pytest.raises(ValueError, match="weight\\[0\\]"):
        kiln.ops.prepared_linear(x, "gguf_planar_Q4_K", [planes[0].float(), *planes[1:]])
    with pytest.raises(ValueError, match="K=255 must be a multiple of 256"):
        kiln.ops.prepared_linear(torch.randn(2, 255), "gguf_planar_Q4_K", planes)
    with pytest.raises(ValueError, match="weight\\[3\\]"):  # mins of the file's uint8, not float32
        kiln.ops.prepared_linear(x, "gguf_planar_Q4_K", [*planes[:3], planes[3].float(), planes[4]])
    with pytest.raises(ValueError, match="holds 5 tensors"):
        kiln.ops.prepared_linear(x, "gguf_planar_Q4_K", planes[:4])
    # the planes themselves run on the CPU too (F.linear on their decoded matrix)
    out = kiln.ops.prepared_linear(x, "gguf_planar_Q4_K", planes)
    assert_close(out, x.double() @ planar_matrix(planes, "Q4_K").T, 1e-5)


def test_every_kernel_type_has_a_planar_layout():
    assert sorted(PLANAR_LAYOUTS.values()) == sorted(KERNEL_QTYPES)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
@pytest.mark.parametrize("M", [1, 300])
def test_planar_gemm_in_bfloat16_on_gpu(qtype, M):
    """bf16 tl.dot is wrong in the Triton interpreter: the bf16 path is checked on a GPU."""
    generator = torch.Generator().manual_seed(seed())
    k = 768 if BLOCK_WEIGHTS[qtype] > 32 else 576
    weight, matrix = blocks_and_matrix(1000, k, qtype, generator)
    x = torch.randn(M, k, generator=generator).to(torch.bfloat16)
    planes = [t.cuda() for t in pack_planar(weight, qtype)]
    out = gguf_planar_linear_triton(x.cuda(), planes, qtype)
    assert_close(out.cpu(), x.double() @ matrix.double().T, 8e-3)


def test_packing_a_few_rows_at_a_time_gives_the_same_planes(monkeypatch):
    """pack_planar packs PACK_WEIGHTS weights at a time (its int64 fields peaked at ~26 bytes a weight:
    ~14 GB for a 128256 x 4096 head at once); the chunks join into the same planes. Empty weights give
    empty planes of the right shapes."""
    import kiln.ops.gemm.gguf_planar as planar

    blocks, _ = blocks_and_matrix(37, 512, "Q5_K", torch.Generator().manual_seed(seed()))
    whole = pack_planar(blocks, "Q5_K")
    monkeypatch.setattr(planar, "PACK_WEIGHTS", 3 * 512)  # 3 rows a chunk, 13 chunks
    assert all(torch.equal(a, b) for a, b in zip(whole, pack_planar(blocks, "Q5_K"), strict=True))
    empty = pack_planar(torch.empty(0, 176, dtype=torch.uint8), "Q5_K")
    assert [tuple(t.shape) for t in empty] == [(0, 32), (0, 8), (0, 8), (0, 8), (0, 2)]


def test_planar_gemm_with_nothing_to_multiply(device):
    """M = 0 gives [0, N]; K = 0 an empty sum: the bias alone (as torch's matmul); leading dims kept."""
    blocks, matrix = blocks_and_matrix(5, 64, "Q4_1", torch.Generator().manual_seed(1))
    planes = [t.to(device) for t in pack_planar(blocks, "Q4_1")]
    assert gguf_planar_linear_triton(torch.randn(0, 64, device=device), planes, "Q4_1").shape == (0, 5)
    x = torch.randn(2, 3, 64)
    out = gguf_planar_linear_triton(x.to(device), planes, "Q4_1")
    assert out.shape == (2, 3, 5)
    assert_close(out.cpu(), x.double() @ matrix.double().T, 1e-5)
    empty = [t.to(device) for t in pack_planar(torch.empty(5, 0, dtype=torch.uint8), "Q4_1")]
    bias = torch.randn(5)
    out = gguf_planar_linear_triton(torch.randn(2, 0, device=device), empty, "Q4_1", bias.to(device))
    assert torch.equal(out.cpu(), bias.expand(2, 5))


def test_planar_gemm_refuses_k_quant_tiles_deeper_than_a_super_block(device):
    """The kernel reads one super-block's d (and dmin) a K tile: BLOCK_K must divide 256."""
    blocks, _ = blocks_and_matrix(16, 512, "Q6_K", torch.Generator().manual_seed(2))
    planes = [t.to(device) for t in pack_planar(blocks, "Q6_K")]
    config = {**SPLIT, "BLOCK_K": 512, "SPLIT_K": 1}
    with pytest.raises(ValueError, match="BLOCK_K=512 must divide 256 for Q6_K"):
        gguf_planar_linear_triton(torch.randn(2, 512, device=device), planes, "Q6_K", config=config)
