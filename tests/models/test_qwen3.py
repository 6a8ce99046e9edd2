"""Qwen3 and Qwen3-MoE in Kiln against transformers on tiny random checkpoints written by
`save_pretrained` (the real HF tensor names and config keys): logits at every prompt position, greedy
tokens, the engine (chunked prefill mixed with decodes) and `kiln generate --model DIR`. The GGUF
round trips are in tests/loaders/test_gguf_qwen3.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.loaders.safetensors import load_safetensors_dir  # noqa: E402
from kiln.models.mixtral import SparseMoE  # noqa: E402
from kiln.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from kiln.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from kiln.models.registry import get_model_class  # noqa: E402
from kiln.verify import assert_close  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402

# head_dim 24 is not hidden_size / num_attention_heads (16): Qwen3 reads it from the config.
COMMON = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
)  # fmt: skip
PROMPT = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 17, 90, 2, 8, 111, 6]  # 17 tokens: crosses blocks


def qwen3(**overrides):
    config = transformers.Qwen3Config(**{**COMMON, "intermediate_size": 96, **overrides})
    return transformers.Qwen3ForCausalLM(config)


def qwen3_moe(**overrides):
    args = dict(
        COMMON, intermediate_size=96, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
    )  # fmt: skip
    config = transformers.Qwen3MoeConfig(**{**args, **overrides})
    return transformers.Qwen3MoeForCausalLM(config)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights large enough that router choices and next-token logits are far from ties (HF's init
    leaves routers at zero and norms at one, which would hide a missing q/k norm)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


def save(hf_model, directory, seed=0):
    randomize(hf_model, seed).save_pretrained(directory)
    return load_safetensors_dir(str(directory))


@torch.no_grad()
def hf_greedy(hf_model, prompt, max_new_tokens):
    """Plain greedy decoding with full forwards (no generation config: EOS may be generated too)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


CASES = {
    "qwen3": (qwen3, {}, Qwen3ForCausalLM),
    "qwen3_tied_embeddings": (qwen3, {"tie_word_embeddings": True}, Qwen3ForCausalLM),
    "qwen3_moe_renormalized_top2_with_a_dense_layer": (qwen3_moe, {}, Qwen3MoeForCausalLM),
    "qwen3_moe_unnormalized_top3_sparse_step_2": (
        qwen3_moe, {"norm_topk_prob": False, "num_experts_per_tok": 3, "decoder_sparse_step": 2,
                    "mlp_only_layers": []}, Qwen3MoeForCausalLM,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_matches_transformers_logits_and_greedy_tokens(case, tmp_path):
    make_hf, overrides, kiln_class = CASES[case]
    hf_model = make_hf(**overrides)
    config, weights = save(hf_model, tmp_path)
    assert get_model_class(config.architecture) is kiln_class
    model = kiln_class(config, weights, device="cpu", dtype=torch.float32)
    unused = set(weights.names()) - weights.used
    assert not unused, f"checkpoint tensors never loaded: {sorted(unused)[:5]}"
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0].float()
    got = prompt_logits(model, PROMPT, block_size=8)
    assert_close(got, expected, 1e-4, "logits at every prompt position")  # fp32, only op order differs
    assert greedy(model, PROMPT, 8, block_size=8) == hf_greedy(hf_model, PROMPT, 8)


def test_qwen3_moe_layers_are_sparse_where_the_config_says(tmp_path):
    config, weights = save(qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[]), tmp_path)
    kinds = [type(layer.mlp) for layer in Qwen3MoeForCausalLM(config, weights).layers]
    assert kinds[1] is SparseMoE and kinds[0] is not SparseMoE and kinds[2] is not SparseMoE
    config, weights = save(qwen3_moe(), tmp_path / "every_layer_but_1")
    moe = [isinstance(layer.mlp, SparseMoE) for layer in Qwen3MoeForCausalLM(config, weights).layers]
    assert moe == [True, False, True]


def test_qwen3_attention_normalizes_q_and_k_with_the_checkpoint_norms(tmp_path):
    config, weights = save(qwen3(), tmp_path)
    model = Qwen3ForCausalLM(config, weights)
    q_weight, k_weight = model.layers[2].self_attn.qk_norm
    assert_close(q_weight, weights.get("model.layers.2.self_attn.q_norm.weight", (24,)), 0.0)
    assert_close(k_weight, weights.get("model.layers.2.self_attn.k_norm.weight", (24,)), 0.0)
    assert model.layers[0].self_attn.qk_norm_eps == config.rms_norm_eps


def test_qwen3_without_its_q_norm_tensor_is_a_load_error_naming_it(tmp_path):
    from kiln.models import ModelLoadError

    config, weights = save(qwen3(), tmp_path)
    del weights._loaders["model.layers.1.self_attn.q_norm.weight"]
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.self_attn\.q_norm\.weight'"):
        Qwen3ForCausalLM(config, weights)


def write_word_tokenizer(directory, vocab_size):
    """A word-level tokenizer.json ("t0" .. "tN") so kiln's loader can open the directory as a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("make_hf", [qwen3, qwen3_moe], ids=["qwen3", "qwen3_moe"])
def test_qwen3_in_the_engine_batches_chunked_prefills_and_decodes_like_transformers(make_hf, tmp_path):
    from kiln import LLM, SamplingParams

    hf_model = make_hf()
    save(hf_model, tmp_path, seed=3)
    write_word_tokenizer(tmp_path, COMMON["vocab_size"])
    prompts = [PROMPT, PROMPT[:4], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    # A 16-token step budget splits the longer prompts into chunks and mixes prefills with decodes.
    llm = LLM(model=str(tmp_path), device="cpu", num_kv_blocks=32, max_num_batched_tokens=16, block_size=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == hf_greedy(hf_model, prompt, 6), f"prompt of {len(prompt)} tokens"


def test_kiln_generate_runs_a_qwen3_checkpoint_directory(tmp_path, capsys):
    from kiln.cli import build_parser

    hf_model = qwen3()
    save(hf_model, tmp_path, seed=4)
    write_word_tokenizer(tmp_path, COMMON["vocab_size"])
    prompt = "t5 t77 t3 t101 t42"
    args = build_parser().parse_args(
        ["generate", prompt, "--model", str(tmp_path), "--max-tokens", "5", "--ignore-eos", "--device", "cpu",
         "--temperature", "0"]
    )  # fmt: skip
    assert args.func(args) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    expected = hf_greedy(hf_model, [5, 77, 3, 101, 42], 5)
    assert lines[0].split() == [f"t{i}" for i in expected]
    assert "5 tokens generated" in lines[-1]
