"""The FP8 KV-cache scales a quantized checkpoint ships, kept for EngineConfig(kv_cache_scales="checkpoint").

compressed-tensors (what llm-compressor writes; config.json's quantization_config has a
`kv_cache_scheme`) stores one per layer and kind, `model.layers.N.self_attn.k_scale` / `v_scale`: float
[1] for strategy "tensor", [num_kv_heads, 1, 1] for "attn_head". Older AutoFP8 / ModelOpt checkpoints
name them `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale` or `k_proj.output_scale` /
`v_proj.output_scale`, and the oldest one `self_attn.kv_scale` for both (read as vLLM reads them, see
its maybe_remap_kv_scale_name). The convention is vLLM's and Kiln's cache's: stored fp8 = value / scale,
value = fp8 * scale (compressed-tensors' scale = max |x| / 448 over its calibration).

The loader reads the tensors as stored (a few numbers a layer) whatever the engine will do with them;
`per_head` checks and shards them only when an engine uses them, so a checkpoint whose scales are
broken still loads for a cache that keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.models.config import ModelLoadError
from kiln.models.sharding import ShardPlan

# per kind, the names under model.layers.N. in the order they are looked for
K_SCALE_NAMES = (
    "self_attn.k_scale", "self_attn.k_proj.k_scale", "self_attn.k_proj.output_scale", "self_attn.kv_scale"
)  # fmt: skip
V_SCALE_NAMES = (
    "self_attn.v_scale", "self_attn.v_proj.v_scale", "self_attn.v_proj.output_scale", "self_attn.kv_scale"
)  # fmt: skip


@dataclass(frozen=True)
class CheckpointKVScales:
    """A checkpoint's KV-cache scale tensors for the decoder layers a model (or its shard) built.

    source: the checkpoint's path; num_kv_heads: the checkpoint's (all ranks'); kv_heads: (start, end),
    the kv heads this model holds (a tensor-parallel rank's, kiln.models.sharding); layers: one entry
    per built layer, from decoder layer first_layer on (a pipeline stage's first), (k, v), each
    (name, tensor as stored) or None where the layer has none.
    """

    source: str
    num_kv_heads: int
    kv_heads: tuple[int, int]
    layers: list[tuple[tuple[str, torch.Tensor] | None, tuple[str, torch.Tensor] | None]]
    first_layer: int = 0

    def per_head(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per built layer (k_scale, v_scale), float32 [this model's kv heads] on the CPU: a one-element
        tensor (per-tensor scale) broadcast to every head, a num_kv_heads one ([H] or [H, 1, 1],
        per-head) sliced to this model's heads. ModelLoadError naming the tensor for a layer without
        one, another shape, or a value that is not finite and > 0."""
        start, end = self.kv_heads
        out = []
        for i, pair in enumerate(self.layers, start=self.first_layer):
            scales = []
            for kind, entry, names in (("k", pair[0], K_SCALE_NAMES), ("v", pair[1], V_SCALE_NAMES)):
                if entry is None:
                    raise ModelLoadError(
                        f"{self.source}: decoder layer {i} has no {kind} scale for the KV cache (looked for "
                        + ", ".join(f"'model.layers.{i}.{n}'" for n in names)
                        + "); the checkpoint's kv scales are incomplete: use kv_cache_scales 'calibrated' "
                        "or 'unit'"
                    )
                name, tensor = entry
                scale = self._checked(name, tensor.float().reshape(-1))
                scale = scale.expand(end - start) if scale.numel() == 1 else scale[start:end]
                scales.append(scale.contiguous())
            out.append((scales[0], scales[1]))
        return out

    def _checked(self, name: str, scale: torch.Tensor) -> torch.Tensor:
        heads = self.num_kv_heads
        if scale.numel() not in (1, heads):
            raise ModelLoadError(
                f"{self.source}: KV-cache scale {name!r} has {scale.numel()} elements, expected 1 (per "
                f"tensor) or num_kv_heads={heads} (per head)"
            )
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            raise ModelLoadError(
                f"{self.source}: KV-cache scale {name!r} holds {scale[bad][0].item()}, expected finite "
                "values > 0 (stored fp8 = value / scale)"
            )
        return scale


def read_kv_scales(weights, config, layers: range, tp_group=None) -> CheckpointKVScales | None:
    """The KV-cache scale tensors of decoder `layers` in `weights` (a WeightStore; they are marked read),
    None when the checkpoint has none. tp_group: a tensor-parallel rank's (kiln.models.layers.tp.TPGroup),
    whose kv heads (kiln.models.sharding.ShardPlan) per_head slices a per-head scale to; None = all."""
    found = []
    for i in layers:
        pair = []
        for names in (K_SCALE_NAMES, V_SCALE_NAMES):
            name = next((f"model.layers.{i}.{n}" for n in names if f"model.layers.{i}.{n}" in weights), None)
            # read in the shape it is stored in: per_head says which shapes it takes
            pair.append(None if name is None else (name, weights.get(name, weights.stored_shape(name))))
        found.append(tuple(pair))
    if all(k is None and v is None for k, v in found) and not _scales_elsewhere(weights, config, layers):
        return None  # (a pipeline stage whose layers lack them while others have them: per_head says so)
    kv_heads = (0, config.num_kv_heads)
    if tp_group is not None:
        kv_heads = ShardPlan(config, tp_group.world_size).shards[tp_group.rank].kv_heads
    return CheckpointKVScales(weights.source, config.num_kv_heads, kv_heads, found, layers.start)


def _scales_elsewhere(weights, config, layers: range) -> bool:
    """Whether a decoder layer outside `layers` has a KV-cache scale in `weights`."""
    names = K_SCALE_NAMES + V_SCALE_NAMES
    others = (i for i in range(config.num_layers) if i not in layers)
    return any(f"model.layers.{i}.{n}" in weights for i in others for n in names)
