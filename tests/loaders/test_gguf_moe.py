"""Mixtral and Qwen2-MoE GGUF files with llama.cpp's stacked expert tensors (ffn_{gate,up,down}_exps,
router ffn_gate_inp, Qwen2-MoE's shared expert *_shexp) load into Kiln's MoE models and match
transformers on the same weights. Mixtral's GGUF arch is "llama" (Q/K rows permuted) with
llama.expert_count. The quantized paths are covered by test_gguf_qwen3.py; tensors here are F32."""

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGUFWriter  # noqa: E402

from kiln.loaders.gguf import load_gguf  # noqa: E402
from kiln.models.mixtral import MixtralForCausalLM  # noqa: E402
from kiln.models.qwen2_moe import Qwen2MoeForCausalLM, SharedExpertMoE  # noqa: E402
from kiln.verify import assert_close  # noqa: E402
from tests.loaders.gguf_tiny import llama_cpp_permute  # noqa: E402
from tests.models.helpers import greedy, prompt_logits  # noqa: E402
from tests.models.test_qwen3 import hf_greedy, randomize  # noqa: E402

COMMON = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rms_norm_eps=1e-5,
)  # fmt: skip
PROMPT = [3, 17, 29, 4, 4, 60, 11, 2, 45, 31, 8]
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip


def write_moe_gguf(hf_model, path, arch: str) -> None:
    """Every tensor in F32 under llama.cpp's names; `arch` "llama" (Mixtral) or "qwen2moe"."""
    c = hf_model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_local_experts if arch == "llama" else c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen2moe":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    writer.add_token_merges([])
    writer.add_eos_token_id(1)
    top = {
        "model.embed_tokens.weight": "token_embd",
        "model.norm.weight": "output_norm",
        "lm_head.weight": "output",
    }
    for name, tensor in hf_model.state_dict().items():
        w = tensor.detach().float().numpy()
        if name in top:
            writer.add_tensor(top[name] + ".weight", w)
            continue
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        if rest == "mlp.experts.gate_up_proj":
            inter = w.shape[1] // 2
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(w[:, :inter]))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(w[:, inter:]))
            continue
        if rest == "mlp.experts.down_proj":
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", w)
            continue
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = c.num_attention_heads if module == "self_attn.q_proj" else c.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        if module == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # llama.cpp stores the shared-expert gate as a vector [hidden]
        writer.add_tensor(f"blk.{layer}.{LAYER_NAMES[module]}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _mixtral():
    config = transformers.MixtralConfig(
        **COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
    )
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe():
    config = transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=80, moe_intermediate_size=40, shared_expert_intermediate_size=56,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


@pytest.mark.parametrize(
    "arch, make_hf, kiln_class",
    [("llama", _mixtral, MixtralForCausalLM), ("qwen2moe", _qwen2_moe, Qwen2MoeForCausalLM)],
)
def test_moe_gguf_with_stacked_experts_matches_transformers(arch, make_hf, kiln_class, tmp_path):
    hf_model = randomize(make_hf(), seed=5)
    path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(hf_model, path, arch)
    config, weights, _, _ = load_gguf(str(path))
    assert config.architecture == kiln_class.__name__
    model = kiln_class(config, weights, cpu_format="fp32", lm_head_format="fp32")
    unused = set(weights.names()) - weights.used
    assert not unused, f"GGUF tensors never loaded: {sorted(unused)[:5]}"
    if arch == "qwen2moe":
        assert all(isinstance(layer.mlp, SharedExpertMoE) for layer in model.layers)
        assert config.extra["norm_topk_prob"] is False and config.attention_bias
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    assert_close(
        prompt_logits(model, PROMPT, block_size=4), expected, 1e-4, "logits at every prompt position"
    )
    assert greedy(model, PROMPT, 6, block_size=4) == hf_greedy(hf_model, PROMPT, 6)
