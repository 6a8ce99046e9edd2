"""Random-weight models: `load_model("random:<preset>")` builds a model of a known shape with no file.

Spec: `random:<preset>[-<N>l][:seed=<int>]`, e.g. `random:llama3-8b` (Llama-3-8B's shapes, 16 GB in
bfloat16), `random:llama3-8b-4l` (the same with 4 layers, for a quick GPU smoke test),
`random:tiny:seed=1` (2 layers, hidden 64, for CPU tests). Default seed 0.

Weights are N(0, 0.02^2) like a freshly initialised HF model (initializer_range 0.02), RMSNorm
weights 1 + N(0, 0.02^2), so activations stay finite and logits are not degenerate. Each tensor comes
from its own torch.Generator seeded by (seed, tensor name), is drawn directly on the target device in
the target dtype, and only when the model builder asks for it (a lazy WeightStore): an 8B model on
CUDA never has a CPU copy, and beyond the model itself only one layer's fused-projection inputs are
alive at a time. Same spec + device + dtype -> the same weights; CPU and CUDA generators differ.

The tokenizer is a stand-in (`RandomTokenizer`): token id i is the text "<i>". Benchmarks feed
random token ids, so no real vocabulary is needed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.weights import WeightStore

PREFIX = "random:"
INIT_STD = 0.02


@dataclass(frozen=True)
class RandomPreset:
    """Shapes of one random model (a Llama-family decoder)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int


PRESETS: dict[str, RandomPreset] = {
    # meta-llama/Meta-Llama-3-8B's config.json
    "llama3-8b": RandomPreset(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
    # small enough for CPU tests: GQA (2 query heads per KV head), vocab above the 256 byte ids
    "tiny": RandomPreset(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
    ),
}

_SPEC = re.compile(r"^(?P<preset>[a-z0-9.\-]+?)(?:-(?P<layers>\d+)l)?(?::seed=(?P<seed>\d+))?$")


def is_random_spec(path: str | None) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse_random_spec(spec: str) -> tuple[str, RandomPreset, int]:
    """`random:<preset>[-<N>l][:seed=<int>]` -> (preset name, preset with N layers, seed).
    Raises ModelLoadError listing the presets for an unknown one."""
    match = _SPEC.match(spec[len(PREFIX) :])
    known = ", ".join(PREFIX + name for name in PRESETS)
    if match is None or match["preset"] not in PRESETS:
        raise ModelLoadError(
            f"{spec}: unknown random model; presets: {known} (optionally -<N>l for N layers, :seed=<int>)"
        )
    preset = PRESETS[match["preset"]]
    if match["layers"] is not None:
        layers = int(match["layers"])
        if layers < 1:
            raise ModelLoadError(f"{spec}: -{layers}l asks for no layers; use at least 1")
        preset = replace(preset, num_layers=layers)
    return match["preset"], preset, int(match["seed"] or 0)


def random_config(preset: RandomPreset, eos_token_ids: Sequence[int]) -> ModelConfig:
    """The ModelConfig of a preset (untied LM head, no biases, no rope scaling, like Llama-3-8B)."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_layers=preset.num_layers,
        num_heads=preset.num_heads,
        num_kv_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        rms_norm_eps=preset.rms_norm_eps,
        rope_theta=preset.rope_theta,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_ids=list(eos_token_ids),
    )


def _tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape ([out, in] for matrices): what LlamaForCausalLM reads."""
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q_size)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def random_tensor(
    name: str, shape: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """One weight drawn on `device` in `dtype`: N(0, INIT_STD^2), or 1 + that for 1-D (norm) weights.
    The generator is seeded by (seed, name), so a tensor does not depend on the build order."""
    # a hash of both, mixed into every bit: the CPU generator (mt19937) keeps only the low 32 bits
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    tensor = torch.randn(shape, generator=generator, device=device, dtype=dtype).mul_(INIT_STD)
    return tensor.add_(1.0) if len(shape) == 1 else tensor


def random_weights(config: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype) -> WeightStore:
    """A lazy WeightStore over every tensor of `config`'s Llama model: each is generated when read."""
    source = f"{PREFIX}seed={seed}"
    loaders = {
        name: (shape, lambda name=name, shape=shape: random_tensor(name, shape, seed, device, dtype))
        for name, shape in _tensor_shapes(config).items()
    }
    return WeightStore(source, loaders)


class RandomTokenizer:
    """Stand-in tokenizer for random-weight models: token id i <-> the text "<i>".

    encode(text) -> ids: each "<i>" in the text is token i, any other character its UTF-8 bytes (ids
    0..255), so decode(ids) -> encode round-trips. decode skips the EOS id unless
    skip_special_tokens=False. No BOS, no chat template.
    """

    _TOKEN = re.compile(r"<(\d+)>")

    def __init__(self, vocab_size: int, source: str = PREFIX):
        self.vocab_size = vocab_size
        self.bos_token_id: int | None = None
        self.eos_token_ids = [vocab_size - 1]  # the last id, as a real vocabulary's special tokens
        self.add_bos_token = False
        self.chat_template: str | None = None
        self.source = source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        pos = 0
        for match in self._TOKEN.finditer(text):
            ids.extend(text[pos : match.start()].encode())
            token = int(match[1])
            if token >= self.vocab_size:
                raise ValueError(
                    f"RandomTokenizer.encode: token <{token}> is outside the vocabulary of {self.vocab_size}"
                )
            ids.append(token)
            pos = match.end()
        ids.extend(text[pos:].encode())
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        skip = set(self.eos_token_ids) if skip_special_tokens else set()
        return "".join(f"<{int(i)}>" for i in ids if int(i) not in skip)

    def token_to_id(self, token: str) -> int | None:
        match = self._TOKEN.fullmatch(token)
        return int(match[1]) if match and int(match[1]) < self.vocab_size else None

    def id_to_token(self, token_id: int) -> str | None:
        return f"<{token_id}>" if 0 <= token_id < self.vocab_size else None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        raise ValueError(f"apply_chat_template: the random model {self.source} has no chat template")

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """As kiln's Tokenizer.encode_chat (same arguments): a random model has no chat template, so
        this raises ValueError naming it."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def load_random(
    spec: str, device: torch.device, dtype: torch.dtype
) -> tuple[ModelConfig, WeightStore, RandomTokenizer]:
    """(config, lazy weights, tokenizer) for a `random:` spec; weights are drawn on `device` in `dtype`."""
    _, preset, seed = parse_random_spec(spec)
    tokenizer = RandomTokenizer(preset.vocab_size, source=spec)
    config = random_config(preset, tokenizer.eos_token_ids)
    return config, random_weights(config, seed, device, dtype), tokenizer
