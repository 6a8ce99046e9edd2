"""Tiny random Llama (llama3 rope scaling), Mistral (sliding window shorter than the prompt) and
Qwen2 (q/k/v biases, tied embeddings) checkpoints written by transformers' `save_pretrained`
(safetensors, one also sharded), loaded by Kiln: same logits as transformers, same greedy tokens."""

import json

import pytest
import torch

from kiln.loaders import load_model
from kiln.loaders.safetensors import load_safetensors_dir
from kiln.models import LlamaForCausalLM, get_model_class
from tests.models.helpers import greedy, prompt_logits

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
)  # fmt: skip
PROMPT = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 17, 90]  # 13 tokens: crosses 8-token blocks
# Same float32 weights and math, different summation order: float32 rounding through 2 layers.
TOL = 1e-5


def _llama3():
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }  # fmt: skip
    config = transformers.LlamaConfig(**COMMON, rope_theta=50000.0, rope_scaling=scaling)
    return transformers.LlamaForCausalLM(config)


def _mistral():
    config = transformers.MistralConfig(**COMMON, sliding_window=5)
    return transformers.MistralForCausalLM(config)


def _qwen2():
    config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=False)
    return transformers.Qwen2ForCausalLM(config)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that next-token logits are far from ties (HF's init is tiny, biases 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)


CASES = {"llama3_rope_scaling": _llama3, "mistral_sliding_window": _mistral, "qwen2_bias_tied": _qwen2}


def _saved(build, tmp_path, **save_kwargs):
    hf = build()
    _randomize(hf, seed=len(tmp_path.name))
    hf.eval().save_pretrained(tmp_path, **save_kwargs)
    config, weights = load_safetensors_dir(str(tmp_path))
    model = get_model_class(config.architecture)(config, weights)
    return hf, model


def _check_against_hf(hf, model, block_size=8, use_cache=True):
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    out = prompt_logits(model, PROMPT, block_size=block_size)
    rel = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    assert rel.max() < TOL
    ours = greedy(model, PROMPT, 10, block_size=block_size)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, pad_token_id=0, use_cache=use_cache
        )
    assert ours == theirs[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_checkpoint_logits_and_greedy_match_transformers(case, tmp_path):
    hf, model = _saved(CASES[case], tmp_path)
    assert isinstance(model, LlamaForCausalLM)
    _check_against_hf(hf, model)


def test_config_switches_are_read_from_config_json(tmp_path):
    _, llama = _saved(_llama3, tmp_path / "llama")
    assert llama.config.rope_scaling["rope_type"] == "llama3" and llama.config.rope_theta == 50000.0
    _, mistral = _saved(_mistral, tmp_path / "mistral")
    assert mistral.config.sliding_window == 5
    assert mistral.layers[0].self_attn.sliding_window == 5
    _, qwen = _saved(_qwen2, tmp_path / "qwen")
    assert qwen.config.tie_word_embeddings and qwen.config.attention_bias
    assert qwen.config.sliding_window is None and qwen.layers[1].self_attn.sliding_window is None


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    hf, model = _saved(_llama3, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _check_against_hf(hf, model)


def _write_tokenizer(directory):
    """A small byte-level BPE tokenizer.json + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, the kiln is hot", "firing pottery at 1200 degrees"], trainer)
    tok.save(str(directory / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    template += "{% if add_generation_prompt %}<assistant>{% endif %}"
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_load_model_on_hf_dir_gives_model_tokenizer_and_config(tmp_path):
    hf = _qwen2()
    _randomize(hf, seed=1)
    hf.eval().save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == "Qwen2ForCausalLM" and loaded.model.config is loaded.config
    tok = loaded.tokenizer
    ids = tok.encode("the kiln is hot")
    assert tok.decode(ids) == "the kiln is hot"
    assert tok.eos_token_ids == [tok.token_to_id("</s>")] and tok.bos_token_id == tok.token_to_id("<s>")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<user>hi</s><assistant>"
    _check_against_hf(hf, loaded.model)


def _edited(build, tmp_path, edit):
    """`build()`'s checkpoint with config.json edited the way older or hand-written files have it;
    transformers loads the edited file too, as the reference."""
    hf = build()
    _randomize(hf, seed=7)
    hf.eval().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    reference = type(hf).from_pretrained(tmp_path, attn_implementation="eager").eval()
    config, weights = load_safetensors_dir(str(tmp_path))
    return reference, get_model_class(config.architecture)(config, weights)


def _windowed_qwen2():
    config = transformers.Qwen2Config(
        **{**COMMON, "num_hidden_layers": 4}, use_sliding_window=True, sliding_window=5, max_window_layers=2
    )
    return transformers.Qwen2ForCausalLM(config)


EDITED = {
    # every Hub Qwen config written before transformers 5: no layer_types, so the window slides only
    # from max_window_layers on (Kiln slid it in every layer: relative logit error 1.61)
    "qwen2_window_without_layer_types": (_windowed_qwen2, lambda c: c.pop("layer_types")),
    # no use_sliding_window key: transformers' default is false (Kiln slid the window)
    "qwen2_window_key_without_use_sliding_window": (
        lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),
        lambda c: (c.pop("use_sliding_window"), c.pop("layer_types"), c.update(sliding_window=5)),
    ),
    # Llama's attention ignores sliding_window, its rope partial_rotary_factor (Kiln honoured both);
    # transformers' generate cache does read sliding_window (a window its forward does not apply), so
    # the reference decodes without a cache
    "llama_with_sliding_window_and_partial_rotary_keys": (
        lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
        lambda c: c.update(sliding_window=5, partial_rotary_factor=0.5),
    ),
}


@pytest.mark.parametrize("case", list(EDITED))
def test_config_keys_are_read_as_transformers_reads_them_for_the_architecture(case, tmp_path):
    build, edit = EDITED[case]
    hf, model = _edited(build, tmp_path, edit)
    _check_against_hf(hf, model, use_cache=not case.startswith("llama"))
