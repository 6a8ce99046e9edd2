"""Checkpoint tensors as the model builders see them.

`GGUFWeight` is a GGUF-quantized matrix kept as its raw blocks (one output row's blocks contiguous,
the layout `kiln.ops.gguf_linear` takes). `WeightStore` maps HF-style tensor names
("model.layers.0.self_attn.q_proj.weight") to lazily loaded tensors; it checks shapes and raises a
ModelLoadError naming the file and tensor for anything missing or mis-shaped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kiln.models.config import ModelLoadError

# Bytes per 32-weight block: Q4_0 = fp16 d + 16 nibble bytes; Q4_1 adds an fp16 min; Q8_0 = d + 32 int8.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
GGUF_BLOCK_SIZE = 32


@dataclass
class GGUFWeight:
    """A [out_features, in_features] matrix stored as GGUF blocks.

    qtype: "Q4_0" | "Q4_1" | "Q8_0"; data: uint8 [out_features, in_features / 32 * block_bytes].
    """

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [out_features, in_features] (exact: fp16 scales times small integers)."""
        n, k = self.shape
        blocks = self.data.view(n, k // GGUF_BLOCK_SIZE, GGUF_BLOCK_BYTES[self.qtype])
        d = blocks[..., 0:2].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
        # One float32 buffer, filled and scaled in place: load time is dominated by these passes.
        q = torch.empty(blocks.shape[:2] + (GGUF_BLOCK_SIZE,), dtype=torch.float32)
        if self.qtype == "Q8_0":
            q.copy_(blocks[..., 2:].contiguous().view(torch.int8))
            return q.mul_(d).view(n, k).to(dtype)
        qs = blocks[..., -16:]
        q[..., :16] = qs & 0x0F  # low nibbles: weights 0..15 of the block
        q[..., 16:] = qs >> 4  # high nibbles: weights 16..31
        if self.qtype == "Q4_0":
            return q.sub_(8.0).mul_(d).view(n, k).to(dtype)
        m = blocks[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
        return q.mul_(d).add_(m).view(n, k).to(dtype)

    def nibbles(self) -> torch.Tensor:
        """Q4_0 / Q4_1 quants as int32 [out_features, in_features] in 0..15: byte j of a block holds
        weight j in its low nibble and weight j + 16 in its high nibble."""
        n, k = self.shape
        nb = k // GGUF_BLOCK_SIZE
        qs = self.data.view(n, nb, GGUF_BLOCK_BYTES[self.qtype])[..., -16:]
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k).to(torch.int32)

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block (d, m) float32 [out_features, in_features / 32] with weight = d * q + m (q in 0..15)."""
        n, k = self.shape
        blocks = self.data.view(n, k // GGUF_BLOCK_SIZE, GGUF_BLOCK_BYTES[self.qtype])
        d = blocks[..., 0:2].contiguous().view(torch.float16).to(torch.float32).squeeze(-1)
        if self.qtype == "Q4_0":
            return d, -8.0 * d
        m = blocks[..., 2:4].contiguous().view(torch.float16).to(torch.float32).squeeze(-1)
        return d, m

    def as_q4_1(self) -> GGUFWeight:
        """The same matrix as Q4_1 blocks (a Q4_0 block is d * (q - 8): Q4_1 with m = -8d, exact in fp16)."""
        if self.qtype != "Q4_0":
            return self
        n, k = self.shape
        blocks = self.data.view(n, k // GGUF_BLOCK_SIZE, GGUF_BLOCK_BYTES["Q4_0"])
        d = blocks[..., 0:2].contiguous().view(torch.float16)
        m = (d.to(torch.float32) * -8.0).to(torch.float16).view(torch.uint8)
        data = torch.cat([blocks[..., 0:2], m, blocks[..., 2:]], dim=-1).reshape(n, -1)
        return GGUFWeight("Q4_1", data, self.shape)

    def rows(self, index: torch.Tensor) -> GGUFWeight:
        """The matrix with its output rows reordered by `index` (blocks never straddle rows)."""
        return GGUFWeight(self.qtype, self.data[index].contiguous(), (int(index.numel()), self.shape[1]))


Weight = torch.Tensor | GGUFWeight


def weight_shape(weight: Weight) -> tuple[int, ...]:
    return tuple(weight.shape)


def cat_rows(weights: list[Weight], dtype: torch.dtype) -> Weight:
    """Stack matrices along the output dim (fused QKV, gate/up). GGUF blocks of one type stay blocks
    (Q4_0 next to Q4_1 becomes Q4_1); other mixes are dequantized to `dtype`."""
    if all(isinstance(w, GGUFWeight) for w in weights):
        qtypes = {w.qtype for w in weights}
        if qtypes == {"Q4_0", "Q4_1"}:
            weights, qtypes = [w.as_q4_1() for w in weights], {"Q4_1"}
        if len(qtypes) == 1:
            data = torch.cat([w.data for w in weights], dim=0)
            return GGUFWeight(weights[0].qtype, data, (data.shape[0], weights[0].shape[1]))
    dense = [w.dequantize(dtype) if isinstance(w, GGUFWeight) else w.to(dtype) for w in weights]
    return torch.cat(dense, dim=0)


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch tensor over a copy of `array` (the source may be a read-only memory map)."""
    return torch.from_numpy(np.ascontiguousarray(array).copy())


class WeightStore:
    """Name -> lazily loaded checkpoint tensor, with shape checks.

    loaders: name -> (shape, load()) where shape is the stored [out, in]-style shape.
    """

    def __init__(self, source: str, loaders: dict[str, tuple[tuple[int, ...], Callable[[], Weight]]]):
        self.source = source
        self._loaders = loaders
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self._loaders

    def names(self) -> list[str]:
        return list(self._loaders)

    def get(self, name: str, shape: tuple[int, ...]) -> Weight:
        """The tensor `name`, which must have `shape`; a ModelLoadError naming file and tensor otherwise."""
        if name not in self._loaders:
            raise ModelLoadError(f"{self.source}: missing tensor {name!r} (expected shape {tuple(shape)})")
        stored_shape, load = self._loaders[name]
        if tuple(stored_shape) != tuple(shape):
            raise ModelLoadError(
                f"{self.source}: tensor {name!r} has shape {tuple(stored_shape)}, expected {tuple(shape)}"
            )
        self.used.add(name)
        try:
            return load()
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{self.source}: cannot read tensor {name!r} ({exc})") from exc

    def get_optional(self, name: str, shape: tuple[int, ...]) -> Weight | None:
        return self.get(name, shape) if name in self._loaders else None
