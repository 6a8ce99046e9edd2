"""kiln.patch on tiny random transformers models: loss and gradients match the unpatched model, a
short training run follows the same losses, revert restores the original forwards, and an
unsupported architecture is refused."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kiln.patch  # noqa: E402
from kiln.verify import assert_close  # noqa: E402

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
)


def _model(kind="llama", seed=0):
    torch.manual_seed(seed)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    return transformers.MistralForCausalLM(transformers.MistralConfig(**TINY))


def _batch(seed=1, batch=2, seq=11):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, TINY["vocab_size"], (batch, seq), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100  # a masked prompt
    return input_ids, labels


def _loss_and_grads(model, input_ids, labels):
    model.zero_grad()
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_patched_loss_and_grads_match_unpatched(kind, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    model = _model(kind)
    input_ids, labels = _batch()
    loss, grads = _loss_and_grads(model, input_ids, labels)
    with kiln.patch.patched(model):
        patched_loss, patched_grads = _loss_and_grads(model, input_ids, labels)
    assert_close(patched_loss, loss, 1e-5, "loss")
    for name, grad in grads.items():
        assert_close(patched_grads[name], grad, 1e-4, name)


def test_patched_model_on_triton_kernels_matches_unpatched(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")  # the Triton forward and backward kernels
    model = _model("llama")
    input_ids, labels = _batch(batch=1, seq=5)
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    loss, grads = _loss_and_grads(model, input_ids, labels)
    monkeypatch.setenv("KILN_BACKEND", "triton")
    with kiln.patch.patched(model):
        patched_loss, patched_grads = _loss_and_grads(model, input_ids, labels)
    assert_close(patched_loss, loss, 1e-5, "loss")
    for name, grad in grads.items():
        assert_close(patched_grads[name], grad, 1e-4, name)


def test_twenty_training_steps_follow_the_same_losses(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    input_ids, labels = _batch()

    def train(patch: bool):
        model = _model("llama", seed=3)
        if patch:
            kiln.patch.apply(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if patch:
            kiln.patch.revert(model)
        return losses

    reference, patched = train(False), train(True)
    assert reference[-1] < reference[0]  # it trains
    for step, (a, b) in enumerate(zip(patched, reference, strict=True)):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)


def test_revert_restores_the_original_forwards_and_logits(monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    model = _model("llama")
    modeling = transformers.models.llama.modeling_llama
    rope = modeling.apply_rotary_pos_emb
    assert not hasattr(rope, "kiln_original")  # no patched model of this architecture is alive
    input_ids, _ = _batch()
    logits = model(input_ids=input_ids).logits
    kiln.patch.apply(model)
    assert "forward" in vars(model.model.norm) and "forward" in vars(model.model.layers[0].mlp)
    assert modeling.apply_rotary_pos_emb is not rope
    assert_close(model(input_ids=input_ids).logits, logits, 1e-5, "patched logits (no labels)")
    assert model(input_ids=input_ids, labels=input_ids).logits is None  # never materialized
    kiln.patch.revert(model)
    assert modeling.apply_rotary_pos_emb is rope
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(model(input_ids=input_ids).logits, logits)
    with pytest.raises(ValueError, match="not patched"):
        kiln.patch.revert(model)


def test_the_output_with_labels_keeps_transformers_layout(monkeypatch):
    """return_dict=False gave (loss, cache): to_tuple() drops the None logits, so index 1 was the cache
    where transformers has the logits. And the cache field is read by its own name (`cache` in
    transformers 5: `past_key_values` is deprecated there)."""
    monkeypatch.setenv("KILN_BACKEND", "cpu")
    model = _model("llama")
    input_ids, labels = _batch()
    want = model(input_ids=input_ids, labels=labels, use_cache=True, return_dict=False)
    want_fields = model(input_ids=input_ids, labels=labels, use_cache=True)
    with kiln.patch.patched(model):
        got = model(input_ids=input_ids, labels=labels, use_cache=True, return_dict=False)
        got_fields = model(input_ids=input_ids, labels=labels, use_cache=True)
    assert len(got) == len(want) and got[1] is None
    assert [type(v) for v in got[2:]] == [type(v) for v in want[2:]]
    assert_close(got[0], want[0], 1e-5, "loss")
    assert list(got_fields.keys()) == [k for k in want_fields.keys() if k != "logits"]


def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own(monkeypatch):
    """TRL's reference model, EMA copies: the copy shared the original's share of the swapped rope, so
    reverting the original put transformers' rope back under the still-patched copy."""
    import copy
    import gc

    monkeypatch.setenv("KILN_BACKEND", "cpu")
    modeling = transformers.models.llama.modeling_llama
    model = kiln.patch.apply(_model("llama"))
    twin = copy.deepcopy(model)
    input_ids, labels = _batch()
    loss = model(input_ids=input_ids, labels=labels).loss
    assert torch.equal(twin(input_ids=input_ids, labels=labels).loss, loss)
    kiln.patch.revert(model)
    assert hasattr(modeling.apply_rotary_pos_emb, "kiln_original")  # the copy still uses Kiln's
    twin_copy = copy.deepcopy(twin)
    del twin
    gc.collect()  # a patched model collected gives its share back
    assert hasattr(modeling.apply_rotary_pos_emb, "kiln_original")
    kiln.patch.revert(twin_copy)
    assert not hasattr(modeling.apply_rotary_pos_emb, "kiln_original")


def test_patching_twice_is_refused(monkeypatch):
    model = _model("llama")
    with kiln.patch.patched(model), pytest.raises(ValueError, match="patched already"):
        kiln.patch.apply(model)


def test_unsupported_architecture_raises_naming_the_supported_ones():
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50)
    with pytest.raises(ValueError, match="model type 'gpt2'.*llama, mistral, qwen2"):
        kiln.patch.apply(transformers.GPT2LMHeadModel(config))


def test_non_silu_mlp_is_refused():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        kiln.patch.apply(model)
