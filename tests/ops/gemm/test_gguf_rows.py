"""kiln.ops.gemm.cpu_gguf_rows: rows of a GGUF table decoded on lookup, and the embedding that keeps
the file's blocks with it. The reference not written by Kiln: `gguf` writes the non-K blocks and
decodes every type (Kiln's packer writes the K-quant blocks, which gguf cannot)."""

import random

import pytest
import torch

from kiln.models.layers.embedding import VocabParallelEmbedding
from kiln.ops.gemm import cpu_gguf_rows
from kiln.quant import quantize_blocks
from kiln.quant.gguf_blocks import GGUFWeight

gguf = pytest.importorskip("gguf")
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def native():
    if not cpu_gguf_rows.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


def _table(qtype: str, v: int, k: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [V, row_bytes], gguf's float32 decode [V, K]) of fresh values: rows at their own
    scales and offsets (the mins and Q4_1's m count)."""
    values = torch.randn(v, k, generator=g) * torch.rand(v, 1, generator=g) + 0.5 * torch.randn(
        v, 1, generator=g
    )
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype.endswith("_K"):
        blocks = quantize_blocks(values, qtype).view(v, -1)
    else:
        blocks = torch.from_numpy(gguf.quants.quantize(values.numpy(), kind)).view(v, -1)
    return blocks, torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind)).view(v, k)


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_rows_are_ggufs_decode_bit_for_bit(qtype, native, monkeypatch):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    v, k = 53, 256 * random.randint(1, 3)
    blocks, table = _table(qtype, v, k, g)
    ids = torch.tensor([0, v - 1, 7, 7, *torch.randint(0, v, (29,), generator=g).tolist()])
    rows = torch.full((ids.shape[0], k), float("nan"))
    rows.copy_(cpu_gguf_rows.gguf_rows(blocks, ids, qtype))
    assert torch.equal(rows, table[ids])  # each product rounded before its sum, as ggml: no FMA
    assert cpu_gguf_rows.gguf_rows(blocks, ids[:0], qtype).shape == (0, k)
    monkeypatch.setitem(cpu_gguf_rows._state, "loaded", False)  # where the library cannot be built
    assert torch.equal(cpu_gguf_rows.gguf_rows(blocks, ids, qtype), table[ids])


def test_gguf_rows_names_malformed_inputs(native):
    g = torch.Generator().manual_seed(5)
    blocks, _ = _table("Q6_K", 9, 256, g)
    op, ids = torch.ops.kiln_cpu.gguf_rows, torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match=r"GGML type 10 has no native decode"):
        op(blocks, ids, 10)
    with pytest.raises(RuntimeError, match=r"id 9 at 1 is outside the table's 9 rows"):
        op(blocks, torch.tensor([0, 9]), 14)
    with pytest.raises(RuntimeError, match=r"id -1 at 0 is outside"):
        op(blocks, torch.tensor([-1]), 14)
    with pytest.raises(RuntimeError, match=r"ids must be int64 \[T\]"):
        op(blocks, ids.int(), 14)
    with pytest.raises(RuntimeError, match=r"row_bytes a multiple of 210"):
        op(blocks[:, :200], ids, 14)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
def test_a_gguf_embedding_keeps_its_blocks_and_looks_up_the_tables_rows(qtype, native):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    blocks, table = _table(qtype, 300, 512, g)
    weight = GGUFWeight(qtype, blocks, (300, 512))
    embedding = VocabParallelEmbedding(weight, device=torch.device("cpu"), dtype=torch.float32)
    assert embedding.weight is None and embedding.blocks.data_ptr() == blocks.data_ptr()  # no copy
    ids = torch.randint(0, 300, (40,), generator=g)
    assert torch.equal(embedding(ids), table[ids])
    half = VocabParallelEmbedding(weight, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert torch.equal(half(ids), table[ids].bfloat16())  # decoded in float32, then the model dtype
    dense = VocabParallelEmbedding(weight.dequantize(), device=torch.device("cpu"), dtype=torch.float32)
    assert dense.blocks is None and torch.equal(dense(ids), embedding(ids))


def test_a_compiled_lookup_holds_the_native_op(native):
    g = torch.Generator().manual_seed(3)
    blocks, table = _table("Q4_K", 40, 256, g)
    lookup = torch.compile(lambda ids: cpu_gguf_rows.gguf_rows(blocks, ids, "Q4_K") * 2.0, fullgraph=True)
    ids = torch.tensor([3, 39, 0])
    assert torch.equal(lookup(ids), table[ids] * 2.0)


def test_the_ggml_type_ids_kiln_passes_its_native_ops_are_ggufs():
    from kiln.quant.gguf_blocks import GGML_TYPE_IDS

    assert GGML_TYPE_IDS == {name: gguf.GGMLQuantizationType[name].value for name in GGML_TYPE_IDS}
