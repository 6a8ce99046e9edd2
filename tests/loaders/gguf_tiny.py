"""Write a tiny HF Llama as a GGUF file the way llama.cpp's converter does (Q/K rows permuted for
its rope layout, per-tensor quantization types, byte-level BPE tokenizer metadata) — test input for
Kiln's GGUF loader that covers Q4_0 / Q4_1 / Q8_0 / F16 / F32 tensors in a few kilobytes (other
types, the K-quants included, through `tensor_types`)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from kiln.quant.gguf_blocks import K_QUANTS, quantize_blocks

Q = GGMLQuantizationType
# Mixed on purpose: every kind of tensor the loader handles appears at least once.
TENSOR_TYPES = {
    "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.F16,
    "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.F32,
}  # fmt: skip
HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of Q/K (pairs (i, i + D/2) become adjacent)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_any(w: np.ndarray, qtype) -> np.ndarray:
    """The GGUF blocks of float32 `w`: the gguf package's encoder; for the K-quants, which it cannot
    encode, Kiln's round-to-nearest one (the blocks are then read back by gguf's decoder)."""
    if qtype.name in K_QUANTS:
        weight = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        return quantize_blocks(weight, qtype.name).numpy()
    return quantize(w.astype(np.float32), qtype)


def roundtrip(w: np.ndarray, qtype) -> np.ndarray:
    """What a float matrix becomes after storing it as `qtype`."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return dequantize(quantize_any(w, qtype), qtype).reshape(w.shape)


def llama3_rope_freq_factors(config) -> np.ndarray:
    """What llama.cpp's converter stores as `rope_freqs.weight` for Llama-3.1 rope scaling: one
    divisor per frequency (1 for short wavelengths, `factor` for long ones, interpolated between)."""
    rope = config.rope_parameters
    dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in inv_freq:
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def set_metadata(writer: GGUFWriter, key: str, value) -> None:
    """Write (or overwrite) one metadata key, its GGUF type from the Python type; None drops it."""
    if value is None:
        writer.kv_data[0].pop(key, None)
        return

    def kind(v):
        if isinstance(v, bool):
            return GGUFValueType.BOOL
        if isinstance(v, int):
            return GGUFValueType.UINT64 if v >= 0 else GGUFValueType.INT64
        if isinstance(v, float):
            return GGUFValueType.FLOAT64
        if isinstance(v, str):
            return GGUFValueType.STRING
        return GGUFValueType.ARRAY

    vtype = kind(value)
    sub_type = None
    if vtype is GGUFValueType.ARRAY:  # one type for all elements: signed if any is negative
        sub_type = kind(min(value)) if value and all(type(v) is int for v in value) else kind(value[0])
    writer.kv_data[0].pop(key, None)
    writer.add_key_value(key, value, vtype, sub_type)


def write_tiny_gguf(
    hf_model, path, *, arch="llama", tied=False, skip=(), vocab_tokens=None, overrides=None, tensor_types=None
) -> dict:
    """Write `hf_model` (a transformers LlamaForCausalLM) to `path`; returns {hf_name: tensor} of the
    weights as stored (after quantization), for loading the same values back into transformers.
    overrides: metadata key -> value written instead (its GGUF type from the Python type; None drops
    the key), for files with broken metadata. tensor_types: GGUF short name -> type, replacing
    TENSOR_TYPES' entries (K-quants need in-features that are multiples of 256)."""
    types = {**TENSOR_TYPES, **(tensor_types or {})}
    c = hf_model.config
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = vocab_tokens or [f"<t{i}>" for i in range(c.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 2 else 1 for i in range(len(tokens))])
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for key, value in (overrides or {}).items():
        set_metadata(writer, key, value)
    stored = {}

    def add(gguf_name, hf_name, qtype, permute_heads=None):
        if gguf_name in skip:
            return
        w = sd[hf_name]
        stored[hf_name] = torch.from_numpy(roundtrip(w, qtype))
        if permute_heads is not None:
            w = llama_cpp_permute(w, permute_heads)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, w.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            writer.add_tensor(gguf_name, quantize_any(w, qtype), raw_dtype=qtype)

    if c.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freq_factors(c))
    add("token_embd.weight", "model.embed_tokens.weight", types["token_embd"])
    add("output_norm.weight", "model.norm.weight", Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", types["output"])
    for i in range(c.num_hidden_layers):
        for short, hf_short in HF_NAMES.items():
            hf_name = f"model.layers.{i}.{hf_short}.weight"
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(short)
            qtype = types.get(short, Q.F32)
            add(f"blk.{i}.{short}.weight", hf_name, qtype, heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if tied:
        stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    return stored


def tiny_gguf_with_reference(folder, name: str, tensor_types: dict, prompt: list[int], seed: int):
    """A tiny Llama (hidden 256, intermediate 512: whole K-quant super-blocks) written to
    folder/name with `tensor_types`, transformers' float32 model loaded from that file, and its logits
    [len(prompt), vocab] over `prompt`: (path, model, logits)."""
    import transformers

    from tests.loaders.test_gguf_loader import tiny_llama

    hf = tiny_llama(
        seed=seed, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    )
    write_tiny_gguf(hf, folder / name, tensor_types=tensor_types)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0]
    return folder / name, ref_model, ref
