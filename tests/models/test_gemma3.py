"""Gemma 3 in Kiln against transformers' Gemma3ForCausalLM on tiny random checkpoints written by
`save_pretrained` (and by a llama.cpp-style GGUF writer): interleaved sliding-window (window 4, shorter
than the prompts) and global layers with their two RoPE bases, (1 + w) norms, q/k norms, GeGLU,
scaled embeddings, query_pre_attn_scalar and final logit soft-capping."""

import dataclasses
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf import GGUFWriter  # noqa: E402

from kiln.cli import build_parser  # noqa: E402
from kiln.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kiln.loaders import load_model  # noqa: E402
from kiln.loaders.safetensors import load_safetensors_dir  # noqa: E402
from kiln.models import ModelConfig, ModelLoadError, get_model_class  # noqa: E402
from kiln.models.gemma3 import Gemma3ForCausalLM  # noqa: E402
from tests.loaders.gguf_tiny import Q, roundtrip  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402
from tests.models.test_llama_family_hf import _write_tokenizer  # noqa: E402

PROMPT = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 17, 90]  # 13 tokens: > window 4, crosses blocks
WINDOW = 4
# Same float32 weights and math, different summation order, through 4-6 layers.
TOL = 1e-4
COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
    sliding_window=WINDOW,
)  # fmt: skip
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _gemma3(seed=0, **overrides):
    args = {
        **COMMON,
        "layer_types": LOCAL_GLOBAL,
        "query_pre_attn_scalar": 20,  # not head_dim: the scale is read from the config
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        **overrides,
    }
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**args))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # norms hold w of (1 + w): around 0; large matrices so logits are far from ties
            param.copy_(0.1 * noise if "norm" in name else 0.3 * noise)
    return model.eval()


CASES = {
    "local_global_linear_rope": {},
    # transformers applies final_logit_softcapping and ignores attn_logit_softcapping (Gemma 3's
    # attention is not soft-capped): so does Kiln.
    "final_softcap": {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0},
    "untied_head_pattern_2": {"tie_word_embeddings": False, "layer_types": None, "sliding_window_pattern": 2},
}


@torch.no_grad()
def _hf_greedy(hf, prompt, max_new_tokens):
    """Greedy decoding by full forwards (no generation config: EOS may be generated too)."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _relative_error(out, ref):
    return ((out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max().item()


def _saved(hf, path):
    hf.save_pretrained(path)
    config, weights = load_safetensors_dir(str(path))
    return config, get_model_class(config.architecture)(config, weights)


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_gemma3_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    hf = _gemma3(**CASES[case])
    config, model = _saved(hf, tmp_path)
    assert isinstance(model, Gemma3ForCausalLM)
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types) and len(PROMPT) > WINDOW
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert _relative_error(prompt_logits(model, PROMPT, block_size=4), ref) < TOL
    assert greedy(model, PROMPT, 8, block_size=4) == _hf_greedy(hf, PROMPT, 8)


def test_sliding_window_and_local_rope_change_the_logits(tmp_path):
    """The checks above would not notice a window or a local RoPE base that did nothing: without them
    Kiln's logits are far from transformers'."""
    hf = _gemma3()
    config, model = _saved(hf, tmp_path)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    _, weights = load_safetensors_dir(str(tmp_path))
    no_window = Gemma3ForCausalLM(dataclasses.replace(config, sliding_window=None), weights)
    assert _relative_error(prompt_logits(no_window, PROMPT), ref) > 1e-2
    extra = dict(config.extra, rope_local_base_freq=config.rope_theta)
    one_rope = Gemma3ForCausalLM(dataclasses.replace(config, extra=extra), weights)
    assert _relative_error(prompt_logits(one_rope, PROMPT), ref) > 1e-2
    assert [layer.self_attn.sliding_window for layer in model.layers] == [WINDOW, None, WINDOW, None]


def test_gemma3_4x_config_keys_read_like_transformers_5_normalizes_them():
    """A Gemma 3 config.json as the released checkpoints have it (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern, no layer_types) gives the same ModelConfig as transformers'
    own reading of it saved back (5.x per-layer-type rope_parameters, explicit layer_types)."""
    legacy = {
        **COMMON, "num_hidden_layers": 7, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    }  # fmt: skip
    ours = ModelConfig.from_hf(legacy)
    normalized = transformers.Gemma3TextConfig(**legacy).to_dict()
    theirs = ModelConfig.from_hf({**normalized, "architectures": ["Gemma3ForCausalLM"]})
    assert (
        ours.layer_types
        == theirs.layer_types
        == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    )
    for c in (ours, theirs):
        assert c.rope_theta == 1_000_000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
        assert c.extra["rope_local_base_freq"] == 10000.0 and c.hidden_act == "gelu_pytorch_tanh"


def test_gemma3_rejects_what_it_does_not_run(tmp_path):
    hf = _gemma3()
    hf.save_pretrained(tmp_path)
    config, weights = load_safetensors_dir(str(tmp_path))
    with pytest.raises(ModelLoadError, match="hidden activation 'silu'"):
        Gemma3ForCausalLM(dataclasses.replace(config, hidden_act="silu"), weights)
    extra = dict(config.extra, use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(dataclasses.replace(config, extra=extra), weights)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"]["sliding_attention"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1000.0}
    with pytest.raises(ModelLoadError, match="sliding_attention has rope_type 'yarn'"):
        ModelConfig.from_hf(raw)


def test_engine_runs_gemma3_over_paged_kv_across_blocks(tmp_path):
    """LLMEngine on the checkpoint directory: two prompts batched, 4-token KV blocks (window 4, so a
    local layer's keys span two blocks), greedy outputs equal to transformers'."""
    hf = _gemma3()
    hf.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", block_size=4, num_kv_blocks=32))
    prompts = {"a": PROMPT, "b": PROMPT[3:10]}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
    for request_id, prompt in prompts.items():
        assert finished[request_id] == _hf_greedy(hf, prompt, 6)


def test_kiln_generate_runs_the_gemma3_checkpoint(tmp_path, capsys):
    hf = _gemma3(vocab_size=320)  # the byte-level tokenizer has 256 byte tokens + merges
    hf.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    args = build_parser().parse_args(
        ["generate", "the kiln is hot", "--model", str(tmp_path), "--max-tokens", "5", "--ignore-eos"]
        + ["--device", "cpu"]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out.rstrip("\n").split("\n")[:-1]
    tokenizer = load_model(str(tmp_path)).tokenizer
    expected = _hf_greedy(hf, tokenizer.encode("the kiln is hot", add_special_tokens=True), 5)
    assert "\n".join(text) == tokenizer.decode(expected)


def test_tensor_parallel_2_runs_gemma3_like_one_process(tmp_path):
    """TP 2 (gloo on the CPU): each rank one kv head's group, half the MLP and vocabulary; same
    greedy tokens as transformers, logits as one process's to float32 rounding."""
    from kiln.distributed import TensorParallelEngine
    from tests.distributed.checkpoints import record_logits, run_to_completion

    hf = _gemma3(**CASES["final_softcap"])
    hf.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", block_size=4, num_kv_blocks=32)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, PROMPT[2:9]]
    single = LLMEngine(config)
    single_logits = record_logits(single)
    single_tokens = run_to_completion(single, prompts, params)
    with TensorParallelEngine(config, tp_size=2, timeout_s=60) as engine:
        tp_logits = record_logits(engine)
        tp_tokens = run_to_completion(engine, prompts, params)
    assert tp_tokens == single_tokens
    assert [single_tokens[f"r{i}"] for i in range(2)] == [_hf_greedy(hf, p, 5) for p in prompts]
    assert len(tp_logits) == len(single_logits)
    for out, ref in zip(tp_logits, single_logits, strict=True):
        assert _relative_error(out, ref) < 1e-5


# ---- GGUF: llama.cpp's gemma3 layout --------------------------------------------------------------

GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}  # fmt: skip
GGUF_TYPES = {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1, "attn_output": Q.F16, "ffn_down": Q.Q8_0}


def write_gemma3_gguf(hf, path, *, metadata=None, tensor_types=None) -> dict:
    """`hf` as llama.cpp's converter writes a Gemma 3 (arch "gemma3"): no Q/K permutation, every norm
    weight stored as 1 + w, the metadata its set_gguf_parameters writes (plus `metadata`: key suffix
    -> value, for the optional keys); each layer matrix as `tensor_types` (GGUF short name -> type;
    default GGUF_TYPES, F32 for the rest) says. Returns {hf_name: tensor} of what the file holds, in
    HF's terms (norms as (1 + w) - 1 in float32), to load into transformers."""
    c = hf.config
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_head_count_kv(c.num_key_value_heads)
    for key, value in (metadata or {}).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    writer.add_token_types([3 if i < 2 else 1 for i in range(c.vocab_size)])
    writer.add_token_merges([])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    stored, types = {}, GGUF_TYPES if tensor_types is None else tensor_types

    def add(gguf_name, hf_name, qtype):
        w = sd[hf_name]
        if hf_name.endswith("norm.weight"):
            w = w.astype(np.float32) + np.float32(1.0)
            stored[hf_name] = torch.from_numpy(w) - 1.0
            writer.add_tensor(gguf_name, w)
            return
        stored[hf_name] = torch.from_numpy(roundtrip(w, qtype))
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, w.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            from gguf.quants import quantize

            writer.add_tensor(gguf_name, quantize(w.astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", Q.F32)
    for i in range(c.num_hidden_layers):
        for short, hf_short in GGUF_NAMES.items():
            add(
                f"blk.{i}.{short}.weight", f"model.layers.{i}.{hf_short}.weight", types.get(short, Q.F32)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    return stored


GGUF_CASES = {
    # What llama.cpp's converter writes for a 1B-style model: nothing about the local layers, so the
    # loader assumes llama.cpp's pattern of 6 and local base 10000, scale head_dim ** -0.5.
    "llama_cpp_defaults": (
        {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 24,
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        {"rope_scaling_type": __import__("gguf").RopeScalingType.LINEAR, "rope_scaling_factor": 2.0},
    ),
    # The optional keys newer writers have: per-layer pattern, local base, attention scale, softcap.
    "explicit_keys": (
        {"final_logit_softcapping": 3.0},
        {"sliding_window_pattern": [t == "sliding_attention" for t in LOCAL_GLOBAL],
         "rope_freq_base_swa": 1000.0, "attention_scale": 20 ** -0.5, "final_logit_softcapping": 3.0,
         "rope_scaling_type": __import__("gguf").RopeScalingType.LINEAR, "rope_scaling_factor": 2.0},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gemma3_gguf_matches_transformers_on_the_stored_weights(case, tmp_path):
    overrides, metadata = GGUF_CASES[case]
    hf = _gemma3(**overrides)
    path = tmp_path / "gemma3.gguf"
    stored = write_gemma3_gguf(hf, path, metadata=metadata)
    with torch.no_grad():
        hf.load_state_dict(stored, strict=False)
    loaded = load_model(str(path), cpu_format="fp32", lm_head_format="fp32")
    model, config = loaded.model, loaded.config
    assert isinstance(model, Gemma3ForCausalLM) and config.layer_types == hf.config.layer_types
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    # fp16 CPU weights (the GGUF default format) hold Q4/Q8/F16 values exactly; activations in fp32
    assert _relative_error(prompt_logits(model, PROMPT, block_size=4), ref) < TOL
    assert greedy(model, PROMPT, 6, block_size=4) == _hf_greedy(hf, PROMPT, 6)


def test_gemma3_gguf_rejects_a_bad_sliding_window_pattern(tmp_path):
    hf = _gemma3()
    path = tmp_path / "bad.gguf"
    write_gemma3_gguf(hf, path, metadata={"sliding_window_pattern": [True, False]})
    with pytest.raises(ModelLoadError, match="sliding_window_pattern' is a list of 2 entries, expected 4"):
        load_model(str(path))


def test_config_json_written_by_transformers_has_what_the_loader_reads(tmp_path):
    hf = _gemma3(**CASES["final_softcap"])
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = ModelConfig.from_hf(raw)
    assert config.rope_theta == 50000.0 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.extra["rope_local_base_freq"] == 1000.0 and config.extra["final_logit_softcapping"] == 3.0
