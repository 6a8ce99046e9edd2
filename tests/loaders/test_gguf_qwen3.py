"""Qwen3 and Qwen3-MoE GGUF files written the way llama.cpp's converter writes them (arch "qwen3" /
"qwen3moe", attn_q_norm / attn_k_norm, the router ffn_gate_inp and the stacked ffn_{gate,up,down}_exps
experts, expert_count / expert_used_count / expert_feed_forward_length, Q/K rows not permuted), loaded
by Kiln and checked against transformers running the same (quantized-then-dequantized) weights."""

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType, GGUFWriter  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from kiln.loaders import load_model  # noqa: E402
from kiln.loaders.gguf import load_gguf  # noqa: E402
from kiln.models import ModelLoadError  # noqa: E402
from kiln.models.mixtral import SparseMoE  # noqa: E402
from kiln.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from kiln.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from kiln.verify import assert_close  # noqa: E402
from tests.loaders.gguf_tiny import roundtrip, set_metadata  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402
from tests.models.test_qwen3 import hf_greedy, qwen3, qwen3_moe, randomize  # noqa: E402

Q = GGMLQuantizationType
# Mixed on purpose: blocks kept as blocks (2-D Q4/Q8), 3-D quantized experts (dequantized), F16, F32.
TENSOR_TYPES = {
    "attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.F16, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_0,
    "ffn_up": Q.F16, "ffn_down": Q.Q8_0, "ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.F16,
    "ffn_down_exps": Q.Q4_0, "token_embd": Q.Q8_0, "output": Q.F16,
}  # fmt: skip
ATTENTION = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
DENSE = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Qwen3-MoE's real template starts like this; enough to see GGUF's chat template reach the tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPT = [3, 17, 29, 4, 4, 60, 11, 2, 45, 31, 8, 100, 7]
TOL = 1e-4  # the same stored values in both; float32 summation order only


def write_qwen3_gguf(hf_model, path, *, arch: str, tied: bool = False, overrides=None) -> dict:
    """Write a transformers Qwen3 / Qwen3-MoE model as llama.cpp's converter does; returns its state
    dict with every tensor replaced by what the file stores (quantized, then dequantized)."""
    c = hf_model.config
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "qwen3moe":
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    letters = list("abcdefghij")  # single byte-level tokens, so text prompts encode (no merges)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *letters]
    tokens += [f"w{i}" for i in range(len(tokens), c.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    writer.add_token_merges([])
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (overrides or {}).items():
        set_metadata(writer, key, value)
    stored = {}

    def add(gguf_name, w, qtype):
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, w.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(gguf_name, quantize(w.astype(np.float32), qtype), raw_dtype=qtype)
        return torch.from_numpy(roundtrip(w, qtype))

    stored["model.embed_tokens.weight"] = add("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    stored["model.norm.weight"] = add("output_norm.weight", sd["model.norm.weight"], Q.F32)
    if not tied:
        stored["lm_head.weight"] = add("output.weight", sd["lm_head.weight"], TENSOR_TYPES["output"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names = dict(ATTENTION)
        if p + "mlp.gate.weight" not in sd:
            names.update(DENSE)
        for short, hf_short in names.items():
            hf_name = f"{p}{hf_short}.weight"
            stored[hf_name] = add(f"blk.{i}.{short}.weight", sd[hf_name], TENSOR_TYPES.get(short, Q.F32))
        if p + "mlp.gate.weight" in sd:
            stored[p + "mlp.gate.weight"] = add(
                f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"], Q.F32
            )
            gate_up, inter = sd[p + "mlp.experts.gate_up_proj"], c.moe_intermediate_size
            gate = add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :inter], TENSOR_TYPES["ffn_gate_exps"])
            up = add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, inter:], TENSOR_TYPES["ffn_up_exps"])
            stored[p + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
            down = sd[p + "mlp.experts.down_proj"]
            stored[p + "mlp.experts.down_proj"] = add(
                f"blk.{i}.ffn_down_exps.weight", down, TENSOR_TYPES["ffn_down_exps"]
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if tied:
        stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    return stored


def _hf_with(hf_model, stored):
    with torch.no_grad():
        missing, unexpected = hf_model.load_state_dict(stored, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return hf_model


# Every quantized row length must be a multiple of 32: hidden 64, q heads x head_dim 2 x 48 = 96,
# intermediate 64, expert intermediate 32.
GGUF_SHAPES = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=48, intermediate_size=64)


@pytest.mark.parametrize(
    "arch, make_hf, kiln_class, overrides",
    [
        ("qwen3", qwen3, Qwen3ForCausalLM, {}),
        ("qwen3", qwen3, Qwen3ForCausalLM, {"tie_word_embeddings": True}),
        ("qwen3moe", qwen3_moe, Qwen3MoeForCausalLM, {"moe_intermediate_size": 32, "num_experts_per_tok": 3}),
    ],
    ids=["qwen3", "qwen3_tied", "qwen3moe_with_a_dense_layer"],
)
def test_qwen3_gguf_logits_and_greedy_match_transformers(arch, make_hf, kiln_class, overrides, tmp_path):
    hf_model = randomize(make_hf(**{**GGUF_SHAPES, **overrides}), seed=7)
    path = tmp_path / f"tiny-{arch}.gguf"
    stored = write_qwen3_gguf(hf_model, path, arch=arch, tied=hf_model.config.tie_word_embeddings)
    hf_model = _hf_with(hf_model, stored)
    config, weights, _, _ = load_gguf(str(path))
    assert config.architecture == kiln_class.__name__ and config.head_dim == 48
    model = kiln_class(config, weights, cpu_format="fp32", lm_head_format="fp32")
    unused = set(weights.names()) - weights.used
    assert not unused, f"GGUF tensors never loaded: {sorted(unused)[:5]}"
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    assert_close(prompt_logits(model, PROMPT, block_size=4), expected, TOL, "logits at every prompt position")
    assert greedy(model, PROMPT, 8, block_size=4) == hf_greedy(hf_model, PROMPT, 8)


def test_qwen3moe_gguf_routing_keys_and_dense_layers_come_from_the_file(tmp_path):
    hf_model = randomize(qwen3_moe(**GGUF_SHAPES, moe_intermediate_size=32), seed=1)
    path = tmp_path / "moe.gguf"
    write_qwen3_gguf(hf_model, path, arch="qwen3moe")
    config, weights, _, _ = load_gguf(str(path))
    extra = config.extra
    assert (extra["num_experts"], extra["num_experts_per_tok"], extra["moe_intermediate_size"]) == (6, 2, 32)
    assert extra["norm_topk_prob"] is True and extra["mlp_only_layers"] == [1]  # layer 1 has no router
    layers = Qwen3MoeForCausalLM(config, weights).layers
    assert [isinstance(layer.mlp, SparseMoE) for layer in layers] == [True, False, True]
    assert weights.get("model.layers.0.mlp.experts.gate_up_proj", (6, 64, 64)).shape == (6, 64, 64)


def test_qwen3moe_gguf_expert_weights_norm_false_turns_renormalization_off(tmp_path):
    hf_model = randomize(qwen3_moe(**GGUF_SHAPES, moe_intermediate_size=32, norm_topk_prob=False), seed=2)
    path = tmp_path / "moe.gguf"
    stored = write_qwen3_gguf(
        hf_model, path, arch="qwen3moe", overrides={"qwen3moe.expert_weights_norm": False}
    )
    hf_model = _hf_with(hf_model, stored)
    config, weights, _, _ = load_gguf(str(path))
    assert config.extra["norm_topk_prob"] is False
    model = Qwen3MoeForCausalLM(config, weights, cpu_format="fp32", lm_head_format="fp32")
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    assert_close(prompt_logits(model, PROMPT), expected, TOL)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"qwen3moe.expert_used_count": 7},
            r"'qwen3moe\.expert_used_count' is 7, expected an integer in \[1, 6\]",
        ),
        ({"qwen3moe.expert_used_count": None}, r"'qwen3moe\.expert_used_count' is missing"),
        ({"qwen3moe.expert_feed_forward_length": None}, r"'qwen3moe\.expert_feed_forward_length' is missing"),
        ({"qwen3moe.expert_count": 100000}, r"'qwen3moe\.expert_count' is 100000"),
        (
            {"qwen3moe.expert_weights_norm": "yes"},
            r"'qwen3moe\.expert_weights_norm' is 'yes', expected a bool",
        ),
    ],
)
def test_qwen3moe_gguf_with_bad_routing_metadata_names_the_key(overrides, message, tmp_path):
    hf_model = randomize(qwen3_moe(**GGUF_SHAPES, moe_intermediate_size=32), seed=0)
    path = tmp_path / "bad.gguf"
    write_qwen3_gguf(hf_model, path, arch="qwen3moe", overrides=overrides)
    with pytest.raises(ModelLoadError, match=message):
        load_gguf(str(path))


def test_load_model_on_a_qwen3_gguf_gives_its_tokenizer_and_chat_template(tmp_path):
    hf_model = randomize(qwen3(**GGUF_SHAPES), seed=3)
    path = tmp_path / "chat.gguf"
    write_qwen3_gguf(hf_model, path, arch="qwen3")
    loaded = load_model(str(path))
    assert isinstance(loaded.model, Qwen3ForCausalLM)
    tok = loaded.tokenizer
    assert tok.eos_token_ids == [2]
    text = tok.apply_chat_template([{"role": "user", "content": "w5 w6"}])
    assert text == "<|im_start|>user\nw5 w6<|im_end|>\n<|im_start|>assistant\n"


def loaded_token_text(path, token_ids):
    tokenizer = load_model(str(path)).tokenizer
    return [tokenizer.decode([t]) for t in token_ids]


def test_kiln_generate_runs_a_qwen3moe_gguf(tmp_path, capsys):
    from kiln.cli import build_parser

    hf_model = randomize(qwen3_moe(**GGUF_SHAPES, moe_intermediate_size=32), seed=4)
    path = tmp_path / "gen.gguf"
    hf_model = _hf_with(hf_model, write_qwen3_gguf(hf_model, path, arch="qwen3moe"))
    args = build_parser().parse_args(
        ["generate", "abcabj", "--model", str(path), "--max-tokens", "4", "--ignore-eos", "--device", "cpu"]
    )
    assert args.func(args) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert "4 tokens generated" in lines[-1]
    # the default GGUF CPU format (fp16 weights) against transformers on the stored fp32 values: the
    # greedy tokens of this prompt are not near ties
    expected = hf_greedy(hf_model, [3, 4, 5, 3, 4, 12], 4)
    assert lines[0] == "".join(loaded_token_text(path, expected))
