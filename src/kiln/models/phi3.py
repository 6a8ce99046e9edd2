"""Phi-3 / Phi-3.5-mini (and Phi-4-mini, same architecture `Phi3ForCausalLM`): a Llama-family decoder
whose checkpoints store two fused projections, with LongRoPE scaling.

    per layer:  h, r = rms_norm(h, r);  h = attn(h);  h, r = rms_norm(h, r);  h = mlp(h)   (as Llama)
    self_attn.qkv_proj.weight [(Hq + 2 Hkv) * D, hidden]: rows q, then k, then v
    mlp.gate_up_proj.weight   [2 I, hidden]:               rows gate, then up
In GGUF (llama.cpp's "phi3"): blk.N.attn_qkv and blk.N.ffn_up (gate and up), not permuted.

Kiln's attention and MLP layers already run q/k/v and gate/up as one GEMM each, so the fused tensors
are read through `FusedProjectionWeights`, which names their row blocks as Llama's q/k/v and gate/up
tensors; the layers put them back together (the same rows, one copy at load). Because the blocks are
plain row slices (GGUF blocks included), tensor parallelism's ShardedWeightStore slices them like any
Llama checkpoint's. The rotary table is LongRoPE's when the config says so (kiln.ops.rope.longrope:
short factors below original_max_position_embeddings, long ones from there on, by position), and
covers only the first rotary_dim dims of a head when partial_rotary_factor < 1 (Phi-4-mini).
A sliding_window in the config applies to every layer (HF's Phi3 masks all layers with it).
"""

from __future__ import annotations

import re

from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaForCausalLM
from kiln.models.sharding import shard_rows
from kiln.models.weights import Weight, WeightStore

_SPLIT_NAME = re.compile(r"(model\.layers\.\d+\.)(self_attn|mlp)\.(q|k|v|gate|up)_proj\.weight$")


class FusedProjectionWeights:
    """A WeightStore view that also answers Llama's names for the row blocks of the fused tensors:
    `...self_attn.{q,k,v}_proj.weight` from `...self_attn.qkv_proj.weight` and
    `...mlp.{gate,up}_proj.weight` from `...mlp.gate_up_proj.weight`. Names the store holds itself
    (a checkpoint already split) are passed through. The last fused tensor read is kept, so q, k and v
    (or gate and up) cost one read of it."""

    def __init__(self, inner: WeightStore, config: ModelConfig):
        self.inner = inner
        self.source = inner.source
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        inter = config.intermediate_size
        self._rows = {
            "q": ("qkv_proj", 0, q, q + 2 * kv),
            "k": ("qkv_proj", q, q + kv, q + 2 * kv),
            "v": ("qkv_proj", q + kv, q + 2 * kv, q + 2 * kv),
            "gate": ("gate_up_proj", 0, inter, 2 * inter),
            "up": ("gate_up_proj", inter, 2 * inter, 2 * inter),
        }
        self._last: tuple[str, Weight] | None = None

    def _split(self, name: str) -> tuple[str, int, int, int] | None:
        """(fused tensor name, first row, end row, fused rows) when `name` is a block of a fused tensor."""
        match = _SPLIT_NAME.match(name)
        if match is None or name in self.inner:
            return None
        fused, start, end, rows = self._rows[match.group(3)]
        return f"{match.group(1)}{match.group(2)}.{fused}.weight", start, end, rows

    def __contains__(self, name: str) -> bool:
        split = self._split(name)
        return name in self.inner if split is None else split[0] in self.inner

    def names(self) -> list[str]:
        names = self.inner.names()
        return names + [n for n in self._virtual_names(names) if n not in names]

    def _virtual_names(self, names: list[str]) -> list[str]:
        out = []
        for name in names:
            for fused, parts in (
                ("self_attn.qkv_proj", ("q", "k", "v")),
                ("mlp.gate_up_proj", ("gate", "up")),
            ):
                if name.endswith(f".{fused}.weight"):
                    prefix = name[: -len(f"{fused}.weight")]
                    section = fused.split(".")[0]
                    out += [f"{prefix}{section}.{p}_proj.weight" for p in parts]
        return out

    def get(self, name: str, shape: tuple[int, ...]) -> Weight:
        """The tensor `name` of `shape` (a row block of a fused tensor when the store has no `name`);
        ModelLoadError naming the file and the fused tensor when that is missing or mis-shaped."""
        split = self._split(name)
        if split is None:
            return self.inner.get(name, shape)
        fused_name, start, end, rows = split
        if self._last is None or self._last[0] != fused_name:
            self._last = (fused_name, self.inner.get(fused_name, (rows, *tuple(shape)[1:])))
        return shard_rows(self._last[1], start, end)

    def get_optional(self, name: str, shape: tuple[int, ...]) -> Weight | None:
        return self.get(name, shape) if name in self else None


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5-mini: LlamaForCausalLM over the fused checkpoint tensors (see the module
    docstring). Same arguments and forward / compute_logits as LlamaForCausalLM."""

    def __init__(self, config: ModelConfig, weights: WeightStore, **kwargs):
        super().__init__(config, FusedProjectionWeights(weights, config), **kwargs)
