"""Mixtral and Qwen2-MoE in Kiln against transformers on tiny random checkpoints (written by
`save_pretrained`, so the real HF tensor names and layouts are what gets loaded)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.loaders.safetensors import load_safetensors_dir  # noqa: E402
from kiln.models.mixtral import MixtralForCausalLM, SparseMoE  # noqa: E402
from kiln.models.qwen2_moe import Qwen2MoeForCausalLM, SharedExpertMoE  # noqa: E402
from kiln.models.registry import get_model_class  # noqa: E402
from kiln.ops.moe.fused_moe import quantize_experts_fp8  # noqa: E402
from kiln.verify import assert_close  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402

COMMON = dict(
    vocab_size=128, hidden_size=128, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
    max_position_embeddings=256,
)  # fmt: skip
PROMPT = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33]


def _mixtral(**overrides):
    args = {**COMMON, "intermediate_size": 80, "num_local_experts": 6, "num_experts_per_tok": 2}
    config = transformers.MixtralConfig(**{**args, **overrides})
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe(**overrides):
    args = dict(
        COMMON, intermediate_size=96, moe_intermediate_size=40, shared_expert_intermediate_size=56,
        num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
    )  # fmt: skip
    config = transformers.Qwen2MoeConfig(**{**args, **overrides})
    return transformers.Qwen2MoeForCausalLM(config)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that router logits and next-token logits are far from ties (HF's init
    leaves the routers at zero, where top-k is arbitrary)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)


def _save(hf_model, tmp_path, seed=0):
    _randomize(hf_model, seed)
    hf_model.eval().save_pretrained(tmp_path)
    return load_safetensors_dir(str(tmp_path))


@torch.no_grad()
def _hf_greedy(hf_model, prompt, max_new_tokens):
    """Plain greedy decoding with full forwards (no generation config: EOS may be generated too)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


CASES = {
    "mixtral": (_mixtral, {}, MixtralForCausalLM),
    "qwen2_moe": (_qwen2_moe, {}, Qwen2MoeForCausalLM),
    "qwen2_moe_renormalized_top4": (
        _qwen2_moe, {"norm_topk_prob": True, "num_experts_per_tok": 4}, Qwen2MoeForCausalLM
    ),
    "mixtral_top1": (_mixtral, {"num_experts_per_tok": 1}, MixtralForCausalLM),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_moe_model_matches_transformers_logits_and_greedy_tokens(case, tmp_path):
    make_hf, overrides, kiln_class = CASES[case]
    hf_model = make_hf(**overrides)
    config, weights = _save(hf_model, tmp_path)
    assert get_model_class(config.architecture) is kiln_class
    model = kiln_class(config, weights, device="cpu", dtype=torch.float32)
    unused = set(weights.names()) - weights.used
    assert not unused, f"checkpoint tensors never loaded: {sorted(unused)[:5]}"

    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0].float()
    got = prompt_logits(model, PROMPT)
    assert_close(got, expected, 1e-4, "logits at every prompt position")  # fp32, only op order differs

    assert greedy(model, PROMPT, 8) == _hf_greedy(hf_model, PROMPT, 8)


def test_moe_layers_are_sparse_where_the_config_says(tmp_path):
    config, weights = _save(_qwen2_moe(decoder_sparse_step=2, mlp_only_layers=[]), tmp_path)
    model = Qwen2MoeForCausalLM(config, weights)
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds[1] is SharedExpertMoE and kinds[0] is not SharedExpertMoE and kinds[2] is not SharedExpertMoE
    config, weights = _save(_mixtral(), tmp_path / "mixtral")
    assert all(type(layer.mlp) is SparseMoE for layer in MixtralForCausalLM(config, weights).layers)


def _write_word_tokenizer(directory, vocab_size):
    """A word-level tokenizer.json ("t0" .. "tN") so kiln's loader can open the directory as a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_mixtral_in_the_engine_batches_chunked_prefills_and_decodes_like_transformers(tmp_path):
    from kiln import LLM, SamplingParams

    hf_model = _mixtral()
    _save(hf_model, tmp_path, seed=3)
    _write_word_tokenizer(tmp_path, COMMON["vocab_size"])
    prompts = [PROMPT, PROMPT[:4], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
    # A 16-token step budget splits the longest prompt into chunks and mixes prefills with decodes.
    llm = LLM(model=str(tmp_path), device="cpu", num_kv_blocks=32, max_num_batched_tokens=16, block_size=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == _hf_greedy(hf_model, prompt, 6), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize(
    "make_hf, kiln_class", [(_mixtral, MixtralForCausalLM), (_qwen2_moe, Qwen2MoeForCausalLM)]
)
def test_fp8_experts_match_transformers_running_the_dequantized_experts(make_hf, kiln_class, tmp_path):
    hf_model = make_hf()
    config, weights = _save(hf_model, tmp_path, seed=5)
    model = kiln_class(config, weights, device="cpu", dtype=torch.float32, expert_format="fp8")
    moe_blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moe_blocks and all(m.w_gate_up.dtype == torch.float8_e4m3fn for m in moe_blocks)
    # HF with its stacked experts replaced by the same per-expert e4m3 round trip: any remaining
    # difference is Kiln's FP8 path, not the quantization error.
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                w8, scale = quantize_experts_fp8(param)
                param.copy_(w8.float() * scale[:, None, None])
        expected = hf_model(torch.tensor([PROMPT])).logits[0].float()
    assert_close(prompt_logits(model, PROMPT), expected, 1e-4, "logits with fp8 experts")


def test_unknown_expert_format_is_rejected(tmp_path):
    config, weights = _save(_mixtral(), tmp_path)
    with pytest.raises(ValueError, match="expert_format must be one of"):
        MixtralForCausalLM(config, weights, expert_format="int4")


def test_engine_config_expert_format_reaches_the_model_and_generates_like_transformers(tmp_path):
    """`LLM(..., expert_format="fp8")` (`--expert-format fp8`): it only reached the model classes before.
    Greedy tokens equal transformers running the same per-expert e4m3 round trip of its experts."""
    from kiln import LLM, SamplingParams

    hf_model = _mixtral()
    _save(hf_model, tmp_path, seed=3)
    _write_word_tokenizer(tmp_path, COMMON["vocab_size"])
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                w8, scale = quantize_experts_fp8(param)
                param.copy_(w8.float() * scale[:, None, None])
    llm = LLM(model=str(tmp_path), device="cpu", num_kv_blocks=32, block_size=16, expert_format="fp8")
    moe_blocks = [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moe_blocks and all(m.w_gate_up.dtype == torch.float8_e4m3fn for m in moe_blocks)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf_model, PROMPT, 6)


def test_expert_format_is_refused_by_name_for_an_unknown_format_or_a_dense_model(tmp_path, capsys):
    from kiln.cli import build_parser
    from kiln.engine.config import EngineConfig
    from kiln.loaders import load_model

    with pytest.raises(ValueError, match="expert_format='int4', expected one of None, 'fp8'"):
        EngineConfig(expert_format="int4")
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, intermediate_size=64, tie_word_embeddings=False)
    )
    llama.save_pretrained(tmp_path)
    _write_word_tokenizer(tmp_path, COMMON["vocab_size"])
    with pytest.raises(ValueError, match="LlamaForCausalLM has no routed experts"):
        load_model(str(tmp_path), expert_format="fp8")
    args = build_parser().parse_args(["generate", "x", "--expert-format", "fp8"])
    assert args.expert_format == "fp8"
    from kiln.server.cli import run as serve

    serve_args = build_parser().parse_args(
        ["serve", "--model", str(tmp_path), "--device", "cpu", "--expert-format", "fp8"]
    )
    assert serve(serve_args) == 1  # a named load error, not a traceback (it was a bare ValueError)
    assert "LlamaForCausalLM has no routed experts" in capsys.readouterr().err
