"""The loaders fuzzed with mutated copies of a small GGUF and a small safetensors checkpoint written
here: truncations, bit flips and random bytes in the headers, header and metadata edits (values of
the wrong type, zero, negative or huge sizes, dropped keys, overlapping tensor ranges). Every mutant
either loads (and its tokenizer works) or fails with a ModelLoadError: never another exception, and
never a hang (each load runs under a 30 s alarm). Derandomized and bounded to well under a minute."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGUFReader  # noqa: E402

from kiln.loaders import load_model  # noqa: E402
from kiln.models import ModelLoadError  # noqa: E402
from tests.loaders.gguf_tiny import write_tiny_gguf  # noqa: E402
from tests.loaders.test_gguf_loader import tiny_llama  # noqa: E402

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TINY = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=64,
)  # fmt: skip
# what a GGUF can hold: no objects, no empty arrays, integers within 64 bits
GGUF_HOSTILE = st.one_of(
    st.sampled_from(
        [0, -1, 1, 3, 2**31, 2**40, 2**63, 2**64 - 1, -(2**63), 1e300, float("nan"), "", "x", True]
    ),
    st.none(),
    st.lists(st.integers(-5, 5), min_size=1, max_size=3),
    st.lists(st.sampled_from(["a", "b c", ""]), min_size=1, max_size=3),
)
HOSTILE = st.one_of(
    st.sampled_from([0, -1, 1, 3, 2**31, 2**40, 2**63, 2**64, -(2**63), 1e300, float("nan"), "", "x", True]),
    st.none(),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.sampled_from(["a", "type"]), st.integers(), max_size=2),
)


class Timeout(Exception):
    pass


@contextlib.contextmanager
def alarm(seconds: float):
    def fire(signum, frame):
        raise Timeout(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def load_or_named_error(path: Path) -> None:
    """The property: a correct load (its tokenizer round-trips a text) or a ModelLoadError."""
    try:
        with alarm(30):
            loaded = load_model(str(path))
            text = "hello world"
            ids = loaded.tokenizer.encode(text)
            loaded.tokenizer.decode(ids)
    except ModelLoadError:
        pass


@pytest.fixture(scope="module")
def model():
    return tiny_llama(**TINY)


class TinyGGUF:
    """The file's bytes, where its tensor data starts, the (byte position, value) of each tensor's
    data-offset field (for structured edits), and its metadata keys."""

    def __init__(self, path: Path):
        reader = GGUFReader(path)
        self.raw = path.read_bytes()
        self.data_start = min(int(t.data_offset) for t in reader.tensors)
        self.offsets = [
            (int(t.field.parts[-1].ctypes.data - reader.data.ctypes.data), int(t.field.parts[-1][0]))
            for t in reader.tensors
        ]
        self.keys = sorted(k for k in reader.fields if not k.startswith("GGUF."))

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"TinyGGUF({len(self.raw)} bytes)"


@pytest.fixture(scope="module")
def gguf_file(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(model, path)
    return TinyGGUF(path)


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_the_unmutated_files_load(gguf_file, hf_dir, tmp_path):
    (tmp_path / "tiny.gguf").write_bytes(gguf_file.raw)
    assert load_model(str(tmp_path / "tiny.gguf")).config.num_layers == 1
    assert load_model(str(hf_dir)).config.num_layers == 1


@st.composite
def byte_mutations(draw, size: int, header_end: int):
    """(kind, arguments): truncation anywhere, bit flips or random bytes in the header region."""
    kind = draw(st.sampled_from(["truncate", "flip", "flip", "bytes"]))
    if kind == "truncate":
        return kind, draw(st.integers(0, size - 1))
    if kind == "flip":
        return kind, draw(
            st.lists(st.tuples(st.integers(0, header_end - 1), st.integers(0, 7)), min_size=1, max_size=4)
        )
    start = draw(st.integers(0, header_end - 1))
    return kind, (start, draw(st.binary(min_size=1, max_size=16)))


def mutate(data: bytes, mutation) -> bytes:
    kind, args = mutation
    if kind == "truncate":
        return data[:args]
    out = bytearray(data)
    if kind == "flip":
        for position, bit in args:
            out[position] ^= 1 << bit
    else:
        start, chunk = args
        out[start : start + len(chunk)] = chunk[: len(out) - start]
    return bytes(out)


@FUZZ
@given(data=st.data())
def test_mutated_gguf_bytes_load_or_fail_by_name(gguf_file, data):
    raw = gguf_file.raw
    mutation = data.draw(byte_mutations(len(raw), gguf_file.data_start))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mutant.gguf"
        path.write_bytes(mutate(raw, mutation))
        load_or_named_error(path)


@FUZZ
@given(data=st.data())
def test_gguf_with_edited_metadata_or_tensor_ranges_loads_or_fails_by_name(gguf_file, model, data):
    raw, offsets, keys = gguf_file.raw, gguf_file.offsets, gguf_file.keys
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mutant.gguf"
        if data.draw(st.booleans()):  # metadata: some keys get hostile values (None drops the key)
            edits = data.draw(st.dictionaries(st.sampled_from(keys), GGUF_HOSTILE, min_size=1, max_size=3))
            write_tiny_gguf(model, path, overrides=edits)
        else:  # a tensor's data offset moved onto another's, into the padding, or past the end
            position, _ = data.draw(st.sampled_from(offsets))
            other = data.draw(st.sampled_from([o for _, o in offsets] + [1, 2**40, len(raw)]))
            out = bytearray(raw)
            out[position : position + 8] = other.to_bytes(8, "little")
            path.write_bytes(bytes(out))
        load_or_named_error(path)


def json_edit(value, draw):
    """`value` (a JSON object) with one entry replaced by a hostile value, or deleted, or the whole
    value replaced."""
    choice = draw(st.sampled_from(["entry", "entry", "delete", "whole"]))
    if choice == "whole" or not isinstance(value, dict) or not value:
        return draw(HOSTILE)
    key = draw(st.sampled_from(sorted(value)))
    value = dict(value)
    if choice == "delete":
        del value[key]
    elif isinstance(value[key], dict) and draw(st.booleans()):
        value[key] = json_edit(value[key], draw)  # one level down (a tensor entry's dtype, shape, ...)
    else:
        value[key] = draw(HOSTILE)
    return value


@FUZZ
@given(data=st.data())
def test_mutated_safetensors_checkpoint_loads_or_fails_by_name(hf_dir, data):
    raw = (hf_dir / "model.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d) / "m"
        shutil.copytree(hf_dir, directory)
        target = data.draw(st.sampled_from(["bytes", "header", "header", "config"]))
        if target == "bytes":
            mutant = mutate(raw, data.draw(byte_mutations(len(raw), 8 + header_len)))
            (directory / "model.safetensors").write_bytes(mutant)
        elif target == "header":
            header = json_edit(json.loads(raw[8 : 8 + header_len]), data.draw)
            encoded = json.dumps(header).encode()
            (directory / "model.safetensors").write_bytes(
                len(encoded).to_bytes(8, "little") + encoded + raw[8 + header_len :]
            )
        else:
            config = json.loads((directory / "config.json").read_text())
            (directory / "config.json").write_text(json.dumps(json_edit(config, data.draw)))
        load_or_named_error(directory)
