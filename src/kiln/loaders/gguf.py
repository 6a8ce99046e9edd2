"""GGUF checkpoints (llama.cpp's format) through the `gguf` package's GGUFReader (over a plain array
view of the file's map: kiln.loaders.gguf_fast_reader).

Config and tokenizer come from the metadata (`<arch>.*`, `tokenizer.ggml.*`, `tokenizer.chat_template`);
tensors are renamed to HF names. Matrices in the block types Kiln's GEMMs read (Q4_0 / Q4_1 / Q5_0 /
Q8_0 and the K-quants Q4_K / Q5_K / Q6_K: kiln.quant.gguf_blocks.KERNEL_QTYPES) stay as their raw
blocks (GGUFWeight; how each device runs them: kiln.ops.gemm.weight_formats); other quantized types
are dequantized with `gguf.quants.dequantize`.

llama.cpp's converter permutes the rows of the Llama Q and K projections (to pair adjacent dims for its
rope); we undo it so the rows are HF's again and NeoX-style (half-split) rope is right.

Malformed files fail with a ModelLoadError naming the file and the key or tensor: unreadable or
truncated files, tensors whose byte ranges overlap, metadata of the wrong type or out of range.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from kiln.loaders.config_checks import check_model_config, is_int
from kiln.loaders.gguf_fast_reader import read_gguf
from kiln.loaders.gguf_gemma3 import (
    GEMMA3_NORM_SHIFT,
    GEMMA3_PER_LAYER,
    complete_gemma3_config,
    is_shifted_norm,
)
from kiln.loaders.gguf_moe import EXPERT_TENSOR_NAMES, apply_moe_metadata, stack_expert_tensors
from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.weights import GGUFWeight, WeightStore, numpy_to_torch
from kiln.quant.gguf_blocks import KERNEL_QTYPES

# GGUF general.architecture -> HF architecture (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
GGUF_ARCHITECTURES["phi3"] = "Phi3ForCausalLM"
# Qwen3 (q/k norms, Q/K not permuted) and the MoE archs (kiln.loaders.gguf_moe; a "llama" file with
# experts is a Mixtral)
GGUF_ARCHITECTURES.update(
    qwen3="Qwen3ForCausalLM", qwen3moe="Qwen3MoeForCausalLM", qwen2moe="Qwen2MoeForCausalLM"
)
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
_PER_LAYER["attn_qkv"] = "self_attn.qkv_proj"  # Phi-3's fused q/k/v rows
_PER_LAYER.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")  # Qwen3
_PER_LAYER.update(EXPERT_TENSOR_NAMES)  # routers, stacked experts, shared experts
# names that mean something else in one architecture: Phi-3's ffn_up holds the gate rows, then the up rows
_ARCH_PER_LAYER = {"phi3": {"ffn_up": "mlp.gate_up_proj"}}
GGUF_ARCHITECTURES["gemma3"] = "Gemma3ForCausalLM"
_ARCH_PER_LAYER["gemma3"] = GEMMA3_PER_LAYER  # Gemma's four norms per layer and q/k norms
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_KEPT_AS_BLOCKS = KERNEL_QTYPES


def hf_tensor_name(name: str, arch: str | None = None) -> str:
    """GGUF tensor name -> HF name in GGUF architecture `arch` (unknown names are kept as they are)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _BLOCK_NAME.match(name)
    per_layer = {**_PER_LAYER, **_ARCH_PER_LAYER.get(arch, {})}
    if match and match.group(2) in per_layer:
        return f"model.layers.{match.group(1)}.{per_layer[match.group(2)]}.{match.group(3)}"
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
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        known = ", ".join(sorted(GGUF_ARCHITECTURES))
        raise ModelLoadError(
            f"{source}: unknown architecture {arch!r} (supported GGUF architectures: {known})"
        )

    def key(name: str, default: Any = None, required: bool = False, kind: type = int) -> Any:
        """The value of `<arch>.<name>`, checked to be an int (or a number, kind=float)."""
        full = f"{arch}.{name}"
        if full not in meta:
            if required:
                raise ModelLoadError(f"{source}: metadata key {full!r} is missing")
            return default
        value = meta[full]
        ok = is_int(value) or (kind is float and isinstance(value, float))
        if not ok or (value < 1 and kind is int):
            expected = "an integer >= 1" if kind is int else "a number"
            raise ModelLoadError(f"{source}: metadata key {full!r} is {value!r}, expected {expected}")
        return kind(value)

    hidden = key("embedding_length", required=True)
    num_heads = key("attention.head_count", required=True)
    tokens = meta.get("tokenizer.ggml.tokens")
    if f"{arch}.vocab_size" not in meta and not (isinstance(tokens, list) and tokens):
        raise ModelLoadError(f"{source}: metadata key 'tokenizer.ggml.tokens' is missing or not a list")
    scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor", required=True, kind=float)}
        if not scaling["factor"] > 0:
            raise ModelLoadError(f"{source}: rope scaling factor {scaling['factor']}, expected > 0")
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{source}: rope scaling {scaling_type!r} is not supported")
    bos, eos = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    for name, value in (("bos", bos), ("eos", eos)):
        if value is not None and not is_int(value):
            raise ModelLoadError(f"{source}: metadata key 'tokenizer.ggml.{name}_token_id' is {value!r}")
    keys = {
        "vocab_size": f"{arch}.vocab_size",
        "hidden_size": f"{arch}.embedding_length",
        "intermediate_size": f"{arch}.feed_forward_length",
        "num_layers": f"{arch}.block_count",
        "num_heads": f"{arch}.attention.head_count",
        "num_kv_heads": f"{arch}.attention.head_count_kv",
        "head_dim": f"{arch}.attention.key_length",
        "max_position_embeddings": f"{arch}.context_length",
    }
    config = ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=key("vocab_size", len(tokens) if isinstance(tokens, list) else None),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length", required=True),
        num_layers=key("block_count", required=True),
        num_heads=num_heads,
        num_kv_heads=key("attention.head_count_kv", num_heads),
        head_dim=key("attention.key_length", hidden // num_heads),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5, kind=float),
        rope_theta=key("rope.freq_base", 10000.0, kind=float),
        rope_scaling=scaling,
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=key("attention.sliding_window"),
        bos_token_id=bos,
        eos_token_ids=[] if eos is None else [eos],
        extra={"gguf_architecture": arch},
        rotary_dim=rotary_dim_from_metadata(meta, arch, hidden // num_heads, source),
    )
    if config.rotary_dim == config.head_dim:
        config.rotary_dim = None
    config = apply_moe_metadata(config, meta, tensor_names, source)
    if arch == "gemma3":
        complete_gemma3_config(config, meta, source)
    return check_model_config(config, source, keys)


def rotary_dim_from_metadata(
    meta: dict[str, Any], arch: str, default_head_dim: int, source: str
) -> int | None:
    """`<arch>.rope.dimension_count` (the dims of a head that RoPE rotates; Phi-4-mini's is 3/4 of
    head_dim), checked even and within the head; None when absent."""
    value = meta.get(f"{arch}.rope.dimension_count")
    if value is None:
        return None
    head_dim = meta.get(f"{arch}.attention.key_length", default_head_dim)
    if not is_int(value) or value < 2 or value % 2 or (is_int(head_dim) and value > head_dim):
        raise ModelLoadError(
            f"{source}: metadata key '{arch}.rope.dimension_count' is {value!r}, expected an even "
            f"integer in [2, head_dim={head_dim}]"
        )
    return int(value)


def open_gguf(path: str) -> tuple[Any, dict[str, Any]]:
    """(GGUFReader, metadata); ModelLoadError naming the file for unreadable or truncated files."""
    try:
        reader = read_gguf(path)
    except Exception as exc:  # the reader raises ValueError / struct / numpy errors on bad bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ModelLoadError(
                f"{path}: truncated file, tensor {tensor.name!r} needs bytes up to {end}, the file has {size}"
            )
        if any(int(d) < 1 for d in tensor.shape):
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} has shape {tensor.shape.tolist()}")
    # each tensor owns its bytes: overlapping ranges would make one tensor read another's data; and
    # writers pack them back to back, each padded to the alignment, so a longer gap means a tensor's
    # type or shape claims fewer bytes than it was written with (a relabelled type loads wrong values)
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    alignment = int(getattr(reader, "alignment", 32) or 32)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise ModelLoadError(
                f"{path}: tensors {first!r} and {second!r} overlap (bytes {begin}..{end} of the file)"
            )
        if begin - end >= alignment:
            raise ModelLoadError(
                f"{path}: tensor {first!r} ends {begin - end} bytes before {second!r} starts (more than the "
                f"{alignment}-byte alignment): its type or shape does not match the bytes written for it"
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
    if len(names) != len(reader.tensors):
        raise ModelLoadError(f"{path}: a tensor name appears twice")
    config = config_from_metadata(meta, names, path)
    arch = config.extra["gguf_architecture"]

    def loader(tensor):
        qtype = GGMLQuantizationType(tensor.tensor_type).name
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        hf_name = hf_tensor_name(tensor.name, arch)
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
            if arch == "gemma3" and is_shifted_norm(hf_name):
                weight = weight - GEMMA3_NORM_SHIFT  # stored as 1 + w; float32 here
            return weight

        return hf_name, shape, load

    loaders = {}
    for tensor in reader.tensors:
        hf_name, shape, load = loader(tensor)
        loaders[hf_name] = (shape, load)
    loaders = stack_expert_tensors(loaders, path)
    rope_inv_freq = None
    if "rope_freqs.weight" in loaders:
        # Llama 3.1 GGUFs carry the llama3 rope scaling as per-frequency divisors.
        shape, load = loaders["rope_freqs.weight"]
        if shape != (config.head_dim // 2,):
            raise ModelLoadError(
                f"{path}: tensor 'rope_freqs.weight' has shape {shape}, expected ({config.head_dim // 2},)"
            )
        factors = load()
        dim = config.head_dim
        base = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        rope_inv_freq = base / factors.double()
    if "rope_factors_long.weight" in loaders or "rope_factors_short.weight" in loaders:
        config.rope_scaling = longrope_from_gguf(config, meta, loaders, path)
    return config, WeightStore(path, loaders), meta, rope_inv_freq


def longrope_from_gguf(config: ModelConfig, meta: dict[str, Any], loaders: dict, path: str) -> dict[str, Any]:
    """Phi-3's LongRoPE scaling dict (kiln.ops.rope.longrope) from llama.cpp's `rope_factors_short` /
    `rope_factors_long` tensors ([rotary_dim / 2] each), `<arch>.rope.scaling.original_context_length`
    and `<arch>.rope.scaling.attn_factor` (the cos/sin multiplier; absent: the LongRoPE default)."""
    arch = config.extra["gguf_architecture"]
    pairs = (config.rotary_dim or config.head_dim) // 2
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for kind in ("short", "long"):
        name = f"rope_factors_{kind}.weight"
        if name not in loaders:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing (LongRoPE needs both factor tables)")
        shape, load = loaders[name]
        if shape != (pairs,):
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {shape}, expected ({pairs},)")
        scaling[f"{kind}_factor"] = [float(v) for v in load().reshape(-1).tolist()]
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if not is_int(original) or original < 2:
        raise ModelLoadError(
            f"{path}: metadata key '{arch}.rope.scaling.original_context_length' is {original!r}, "
            "expected an integer >= 2 (LongRoPE needs it)"
        )
    scaling["original_max_position_embeddings"] = int(original)
    attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        if isinstance(attn_factor, bool) or not isinstance(attn_factor, int | float) or not attn_factor > 0:
            raise ModelLoadError(f"{path}: metadata key '{arch}.rope.scaling.attn_factor' is {attn_factor!r}")
        scaling["attention_factor"] = float(attn_factor)
    return scaling
