"""GGUF checkpoints (llama.cpp's format) through the `gguf` package's GGUFReader.

Config and tokenizer come from the metadata (`<arch>.*`, `tokenizer.ggml.*`, `tokenizer.chat_template`);
tensors are renamed to HF names. Q4_0 / Q4_1 / Q8_0 matrices stay as their raw blocks (GGUFWeight),
other quantized types are dequantized with `gguf.quants.dequantize`.

llama.cpp's converter permutes the rows of the Llama Q and K projections (to pair adjacent dims for its
rope); we undo it so the rows are HF's again and NeoX-style (half-split) rope is right.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.weights import GGUFWeight, WeightStore, numpy_to_torch

# GGUF general.architecture -> HF architecture (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_PERMUTED_QK = ("llama", "mistral")  # archs whose converter permutes Q/K rows

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_KEPT_AS_BLOCKS = ("Q4_0", "Q4_1", "Q8_0")


def hf_tensor_name(name: str) -> str:
    """GGUF tensor name -> HF name (unknown names are kept as they are)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _BLOCK_NAME.match(name)
    if match and match.group(2) in _PER_LAYER:
        return f"model.layers.{match.group(1)}.{_PER_LAYER[match.group(2)]}.{match.group(3)}"
    return name


def unpermute_rows(num_heads: int, rows: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's Q/K permutation: GGUF row h*D + 2j + s holds HF row
    h*D + s*D/2 + j (head h, pair j, half s)."""
    head_dim = rows // num_heads
    h, s, j = torch.meshgrid(
        torch.arange(num_heads), torch.arange(2), torch.arange(head_dim // 2), indexing="ij"
    )
    return (h * head_dim + 2 * j + s).reshape(-1)


def read_metadata(reader: Any) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], source: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        known = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ModelLoadError(
            f"{source}: unknown architecture {arch!r} (supported GGUF architectures: {known})"
        )

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        if full not in meta:
            if required:
                raise ModelLoadError(f"{source}: metadata key {full!r} is missing")
            return default
        return meta[full]

    hidden = int(key("embedding_length", required=True))
    num_heads = int(key("attention.head_count", required=True))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{source}: rope scaling {scaling_type!r} is not supported")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    head_dim = int(key("attention.key_length", hidden // num_heads))
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(key("vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_layers=int(key("block_count", required=True)),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=key("attention.sliding_window"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
        extra={"gguf_architecture": arch},
    )


def open_gguf(path: str) -> tuple[Any, dict[str, Any]]:
    """(GGUFReader, metadata); ModelLoadError naming the file for unreadable or truncated files."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError / struct / numpy errors on bad bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ModelLoadError(
                f"{path}: truncated file, tensor {tensor.name!r} needs bytes up to {end}, the file has {size}"
            )
    try:
        meta = read_metadata(reader)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF metadata ({exc})") from exc
    return reader, meta


def load_gguf(path: str) -> tuple[ModelConfig, WeightStore, dict[str, Any], torch.Tensor | None]:
    """(config, weights under HF names, metadata, rope inv_freq or None) of a GGUF file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader, meta = open_gguf(path)
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, names, path)
    arch = config.extra["gguf_architecture"]

    def loader(tensor):
        qtype = GGMLQuantizationType(tensor.tensor_type).name
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        hf_name = hf_tensor_name(tensor.name)
        permute_heads = None
        if arch in _PERMUTED_QK and re.search(r"self_attn\.(q|k)_proj\.(weight|bias)$", hf_name):
            permute_heads = config.num_heads if ".q_proj." in hf_name else config.num_kv_heads

        def load():
            if qtype in _KEPT_AS_BLOCKS and len(shape) == 2:
                weight = GGUFWeight(qtype, numpy_to_torch(tensor.data).view(shape[0], -1), shape)
            elif qtype in ("F32", "F16"):
                weight = numpy_to_torch(tensor.data).float().reshape(shape)
            elif qtype == "BF16":
                weight = numpy_to_torch(tensor.data).view(torch.bfloat16).float().reshape(shape)
            else:
                weight = (
                    torch.from_numpy(dequantize(np.asarray(tensor.data), tensor.tensor_type))
                    .float()
                    .reshape(shape)
                )
            if permute_heads is not None:
                index = unpermute_rows(permute_heads, shape[0])
                weight = weight.rows(index) if isinstance(weight, GGUFWeight) else weight[index].contiguous()
            return weight

        return hf_name, shape, load

    loaders = {}
    for tensor in reader.tensors:
        hf_name, shape, load = loader(tensor)
        loaders[hf_name] = (shape, load)
    rope_inv_freq = None
    if "rope_freqs.weight" in loaders:
        # Llama 3.1 GGUFs carry the llama3 rope scaling as per-frequency divisors.
        factors = loaders["rope_freqs.weight"][1]()
        dim = config.head_dim
        base = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        rope_inv_freq = base / factors.double()
    return config, WeightStore(path, loaders), meta, rope_inv_freq
