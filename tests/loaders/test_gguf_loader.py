"""Kiln's GGUF loader on tiny llama.cpp-style files: Q/K un-permuting, Q4_0/Q4_1/Q8_0/F16/F32
tensors, tied and untied heads, config from metadata — checked against transformers running the
same (quantized-then-dequantized) weights."""

import pytest
import torch

pytest.importorskip("gguf")

from kiln.loaders import load_model  # noqa: E402
from kiln.loaders.gguf import load_gguf, unpermute_rows  # noqa: E402
from kiln.models import LlamaForCausalLM, ModelLoadError  # noqa: E402
from kiln.models.weights import GGUFWeight  # noqa: E402
from tests.loaders.gguf_tiny import llama_cpp_permute, write_tiny_gguf  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402

transformers = pytest.importorskip("transformers")

PROMPT = [3, 17, 29, 4, 4, 60, 11, 2, 45, 31, 8]
# The GGUF values are loaded into transformers too, so only float32 summation order differs.
TOL = 1e-5


def tiny_llama(seed=0, **overrides):
    args = dict(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**args, **overrides}))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return model.eval()


def _hf_with(hf, stored):
    with torch.no_grad():
        hf.load_state_dict(stored, strict=False)
    return hf


def test_unpermute_rows_inverts_llama_cpp_permutation():
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(6 * 8, 3)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(permuted[unpermute_rows(6, 48)], w)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_dequantize_is_bit_identical_to_gguf_package(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qt = GGMLQuantizationType[qtype]
    w = torch.randn(7, 96, generator=torch.Generator().manual_seed(3)).numpy() * 2.5
    data = torch.from_numpy(quantize(w, qt))
    weight = GGUFWeight(qtype, data, (7, 96))
    expected = torch.from_numpy(dequantize(data.numpy(), qt)).reshape(7, 96)
    assert torch.equal(weight.dequantize(), expected)
    assert torch.equal(weight.as_q4_1().dequantize(), expected)  # Q4_0 -> Q4_1 is exact too


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_logits_and_greedy_match_transformers(tmp_path, tied):
    hf = tiny_llama(tie_word_embeddings=tied)
    path = tmp_path / "tiny.gguf"
    stored = write_tiny_gguf(hf, path, tied=tied)
    hf = _hf_with(hf, stored)
    config, weights, _, _ = load_gguf(str(path))
    assert config.tie_word_embeddings == tied and config.num_kv_heads == 2 and config.head_dim == 16
    model = LlamaForCausalLM(config, weights, cpu_format="fp32", lm_head_format="fp32")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    out = prompt_logits(model, PROMPT, block_size=4)
    rel = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    assert rel.max() < TOL
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert greedy(model, PROMPT, 8, block_size=4) == theirs[0, len(PROMPT) :].tolist()


def test_llama3_rope_freqs_tensor_gives_hf_llama3_rope_scaling(tmp_path):
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }  # fmt: skip
    hf = tiny_llama(seed=4, rope_scaling=scaling, rope_theta=10000.0)
    path = tmp_path / "llama31.gguf"
    hf = _hf_with(hf, write_tiny_gguf(hf, path))
    config, weights, _, inv_freq = load_gguf(str(path))
    assert inv_freq is not None and config.rope_scaling is None  # the scaling lives in the tensor
    model = LlamaForCausalLM(
        config, weights, cpu_format="fp32", lm_head_format="fp32", rope_inv_freq=inv_freq
    )
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    out = prompt_logits(model, PROMPT, block_size=4)
    rel = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    assert rel.max() < TOL
    # and without the scaling the positions past the first few would differ
    plain = LlamaForCausalLM(config, weights, cpu_format="fp32", lm_head_format="fp32")
    assert ((prompt_logits(plain, PROMPT) - ref).norm() / ref.norm()) > 100 * TOL


def test_tiny_gguf_cpu_formats_agree_with_float32(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama(seed=1), path)
    config, weights, _, _ = load_gguf(str(path))
    exact = prompt_logits(LlamaForCausalLM(config, weights, cpu_format="fp32", lm_head_format="fp32"), PROMPT)
    # fp16 weights/activations: a few 2^-11 roundings; int4 (Q4_0/Q4_1 packed): bfloat16 (2^-8) ones.
    for cpu_format, tol in (("fp16", 5e-3), ("int4", 5e-2)):
        model = LlamaForCausalLM(config, weights, cpu_format=cpu_format, lm_head_format=cpu_format)
        if cpu_format == "int4":
            assert model.layers[0].self_attn.o_proj.format == "dense"  # F16 tensor: not packable
            assert model.layers[0].self_attn.qkv_proj.format == "dense"  # Q4_0 + Q4_1 + Q8_0 rows
            assert model.layers[0].mlp.gate_up_proj.format == "int4"  # Q4_1 gate + Q4_0 up, as Q4_1
        out = prompt_logits(model, PROMPT)
        rel = (out.double() - exact.double()).norm(dim=-1) / exact.double().norm(dim=-1)
        assert rel.max() < tol, cpu_format


def test_load_model_reads_gguf_config_and_tokenizer(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama(), path)
    loaded = load_model(str(path))
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.config.num_layers == 2 and loaded.config.intermediate_size == 96
    assert loaded.tokenizer.eos_token_ids == [1] and loaded.tokenizer.bos_token_id == 0
    assert loaded.config.eos_token_ids == [1]
    assert loaded.tokenizer.vocab_size == 64


def test_missing_gguf_tensor_names_file_and_tensor(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama(), path, skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(path))


@pytest.mark.gpu
def test_tiny_gguf_on_cuda_keeps_blocks_for_gguf_linear_and_matches_cpu(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama(seed=2), path)
    config, weights, _, _ = load_gguf(str(path))
    exact = prompt_logits(LlamaForCausalLM(config, weights, cpu_format="fp32", lm_head_format="fp32"), PROMPT)
    for dtype, tol in ((torch.float16, 5e-3), (torch.bfloat16, 3e-2)):  # 2^-11 / 2^-8 activation roundings
        model = LlamaForCausalLM(config, weights, device="cuda", dtype=dtype)
        assert model.layers[0].mlp.gate_up_proj.format == "gguf"  # Q4_1 + Q4_0 rows fused as Q4_1
        assert model.layers[0].mlp.down_proj.format == "gguf"  # Q8_0
        out = prompt_logits(model, PROMPT, block_size=4).cpu()
        rel = (out.double() - exact.double()).norm(dim=-1) / exact.double().norm(dim=-1)
        assert rel.max() < tol, dtype
