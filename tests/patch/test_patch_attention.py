"""kiln.patch swaps attention for Kiln's FlashAttention (attn_implementation "kiln"): a patched tiny
model's loss and gradients match the unpatched model's with Kiln's kernel actually running (causal
and Mistral's sliding window), a padded batch falls back to SDPA, and torch.compile runs the patched
model to the same loss."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kiln.ops.autograd  # noqa: E402
import kiln.patch  # noqa: E402
from kiln.verify import assert_close  # noqa: E402

# head_dim 64: a head size Kiln's FlashAttention supports; GQA (2 query heads per kv head)
TINY = dict(
    vocab_size=97,
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def _model(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    return transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=5))


def _ids(seed=1, batch=2, seq=13):
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, **batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def kiln_attention_calls(monkeypatch):
    calls = []
    real = kiln.ops.autograd.flash_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("sliding_window"))
        return real(*args, **kwargs)

    monkeypatch.setattr(kiln.ops.autograd, "flash_attention", counting)
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_patched_attention_loss_and_grads_match(kind, kiln_attention_calls, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    model = _model(kind)
    ids = _ids()
    loss, grads = _loss_and_grads(model, input_ids=ids, labels=ids)
    with kiln.patch.patched(model):
        assert model.config._attn_implementation == "kiln"
        patched_loss, patched_grads = _loss_and_grads(model, input_ids=ids, labels=ids)
    assert len(kiln_attention_calls) == TINY["num_hidden_layers"]  # Kiln's kernel ran in every layer
    if kind == "mistral":
        assert kiln_attention_calls == [5, 5]
    assert model.config._attn_implementation != "kiln"  # reverted
    assert_close(patched_loss, loss, 1e-5, "loss")
    for name, grad in grads.items():
        assert_close(patched_grads[name], grad, 1e-4, name)


def test_padded_batch_falls_back_to_sdpa_and_matches(kiln_attention_calls, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    model = _model("llama")
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: not the plain causal mask
    labels = ids.masked_fill(mask == 0, -100)
    loss, _ = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    with kiln.patch.patched(model):
        patched_loss, _ = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert kiln_attention_calls == []
    assert_close(patched_loss, loss, 1e-5, "loss")


def test_torch_compile_of_patched_model_gives_the_same_loss(monkeypatch):
    # aot_eager: dynamo and AOT autograd trace the custom ops (fakes, registered backwards) as
    # inductor does, without minutes of C++ compilation on a CPU runner.
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    model = _model("llama")
    ids = _ids()
    loss, grads = _loss_and_grads(model, input_ids=ids, labels=ids)
    torch._dynamo.reset()
    with kiln.patch.patched(model):
        compiled = torch.compile(model, backend="aot_eager")
        compiled_loss, compiled_grads = _loss_and_grads(compiled, input_ids=ids, labels=ids)
    assert_close(compiled_loss, loss, 1e-5, "loss")
    for name, grad in grads.items():  # the compiled wrapper names parameters "_orig_mod.<name>"
        assert_close(compiled_grads[f"_orig_mod.{name}"], grad, 1e-4, name)
