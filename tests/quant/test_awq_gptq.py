"""AWQ (GEMM) and GPTQ checkpoints -> int4_linear's layout. Their own packers need a GPU, so these are
known-answer tests on the documented bit layouts (hand-checked words), round trips through Kiln's
packers (kiln.quant.awq.pack_awq, kiln.quant.gptq.pack_gptq_qweight), and the converted weight run
through prepared_linear (int4_linear, act-order permutation included) against the dequantized formula."""

import pytest
import torch

import kiln.ops
from kiln.ops.gemm.quantized_layouts import w4a16_layout
from kiln.quant.awq import AWQ_ORDER, awq_to_int4, pack_awq, unpack_awq
from kiln.quant.gptq import gptq_to_int4, pack_gptq_qweight
from kiln.quant.int4 import pack_int4
from kiln.verify import assert_close


def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_awq_word_known_answer():
    """Columns 0..7 holding 1..8: nibble i is column AWQ_ORDER[i] = [0,2,4,6,1,3,5,7], so the word
    is 0x86427531 (nibble 7 .. nibble 0 = columns 7,5,3,1,6,4,2,0 = values 8,6,4,2,7,5,3,1)."""
    values = torch.arange(1, 9, dtype=torch.int32)[None]
    assert pack_awq(values).item() == _int32(0x86427531)
    assert unpack_awq(torch.tensor([[_int32(0x86427531)]], dtype=torch.int32)).tolist() == [list(range(1, 9))]
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)


def test_gptq_word_known_answer_and_v1_zero_convention():
    """qweight [K/8, N] packed along K: q[k] = k + 1 for k = 0..7 is the word 0x87654321; a stored
    zero of 7 in the v1 format means zero 8, so w[k] = (k + 1 - 8) * 0.5."""
    qweight = torch.tensor([[_int32(0x87654321)]], dtype=torch.int32)  # K = 8, N = 1
    assert pack_gptq_qweight(torch.arange(1, 9)[None]).item() == _int32(0x87654321)
    qzeros = torch.tensor([[7]], dtype=torch.int32)  # G = 1, N / 8 = 1: column 0's nibble
    scales = torch.tensor([[0.5]], dtype=torch.float16)
    w = gptq_to_int4(qweight, qzeros, scales, None, -1).dequantize()
    assert w.tolist() == [[(k + 1 - 8) * 0.5 for k in range(8)]]
    w2 = gptq_to_int4(qweight, qzeros, scales, None, -1, zeros_plus_one=False).dequantize()
    assert w2.tolist() == [[(k + 1 - 7) * 0.5 for k in range(8)]]


def _random_int4(n, k, groups, generator):
    q = torch.randint(0, 16, (k, n), generator=generator, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, n), generator=generator, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=generator) + 0.5).half() / 16
    return q, zeros, scales


def test_awq_round_trip_and_linear():
    """Packed by Kiln's AWQ packer, converted, dequantized: the AWQ formula; run through prepared_linear."""
    generator = torch.Generator().manual_seed(1)
    k, n, gs = 256, 48, 64
    q, zeros, scales = _random_int4(n, k, k // gs, generator)
    weight = awq_to_int4(pack_awq(q), pack_awq(zeros), scales, gs)
    g = torch.arange(k) // gs
    expected = ((q - zeros[g]).float() * scales[g].float()).T
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(5, k, generator=generator)
    layout, tensors = w4a16_layout(weight, torch.device("cpu"))
    assert_close(kiln.ops.prepared_linear(x, layout, list(tensors)), x @ expected.T, 1e-5)


@pytest.mark.parametrize("v2", [False, True])
def test_gptq_act_order_round_trip_and_linear(v2):
    """g_idx a shuffled assignment of inputs to groups (desc_act): the weight is stored sorted by group,
    int4_linear reads x[:, perm]; both equal the GPTQ formula with g_idx."""
    generator = torch.Generator().manual_seed(2)
    k, n, gs = 256, 32, 128
    q, zeros, scales = _random_int4(n, k, k // gs, generator)
    g_idx = (torch.arange(k) // gs)[torch.randperm(k, generator=generator)].to(torch.int32)
    stored_zeros = zeros if v2 else (zeros - 1).clamp(min=0)
    zeros = stored_zeros if v2 else stored_zeros + 1
    qzeros = pack_int4(stored_zeros)  # [G, N / 8], packed along N
    weight = gptq_to_int4(pack_gptq_qweight(q.T), qzeros, scales, g_idx, gs, zeros_plus_one=not v2)
    gi = g_idx.long()
    expected = ((q - zeros[gi]).float() * scales[gi].float()).T
    assert weight.perm is not None
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(3, k, generator=generator)
    layout, tensors = w4a16_layout(weight, torch.device("cpu"))
    assert layout == "w4a16_g128_perm"
    assert_close(kiln.ops.prepared_linear(x, layout, list(tensors)), x @ expected.T, 1e-5)


def test_gptq_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="scales"):
        gptq_to_int4(torch.zeros(32, 16, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                     torch.zeros(3, 16), None, 128)  # fmt: skip


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_group_actorder_g_idx_known_answer(symmetric):
    """compressed-tensors' pack-quantized weight with `weight_g_idx` (actorder "group", which
    llm-compressor wrote until 2026-08; its compressed-tensors no longer has the g_idx path to compare
    with): codes packed by compressed-tensors' own pack_to_int32, and Kiln's weight equals the
    documented rule, column k dequantized with group g_idx[k]'s scale and zero point."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from kiln.quant.compressed_tensors import pack_quantized_int4

    generator = torch.Generator().manual_seed(5)
    n, k, gs = 16, 256, 64
    codes = torch.randint(-8, 8, (n, k), generator=generator)  # the library's signed 4-bit values
    scales = torch.rand(n, k // gs, generator=generator) + 0.05
    g_idx = (torch.arange(k) // gs)[torch.randperm(k, generator=generator)].to(torch.int32)
    packed = pack_to_int32(codes.to(torch.int8), 4)
    zero_point, zeros = None, torch.zeros(n, k // gs, dtype=torch.int64)
    if not symmetric:
        zeros = torch.randint(-8, 8, (n, k // gs), generator=generator)
        zero_point = pack_to_int32(zeros.to(torch.int8), 4, packed_dim=0)
    weight = pack_quantized_int4(packed, scales, k, gs, zero_point, "m", g_idx)
    gi = g_idx.long()
    expected = (codes - zeros[:, gi]).float() * scales[:, gi]
    assert weight.perm is not None
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(3, k, generator=generator)
    layout, tensors = w4a16_layout(weight, torch.device("cpu"))
    assert_close(kiln.ops.prepared_linear(x, layout, list(tensors)), x @ expected.T, 1e-5)
    with pytest.raises(ValueError, match=r"m\.weight_g_idx: .*groups of"):
        pack_quantized_int4(packed, scales, k, gs, zero_point, "m", torch.zeros(k, dtype=torch.int32))
