"""Checkpoint tensors as the model builders see them.

`GGUFWeight` (defined in kiln.quant.gguf_blocks, re-exported here) is a GGUF-quantized matrix kept as
its raw blocks (one output row's blocks contiguous, the layout `kiln.ops.gguf_linear` takes);
`ScaledWeight`, `BlockFP8Weight`, `Int4Weight` (kiln.quant.linear_weights) are quantized checkpoint
weights (compressed-tensors, block FP8, AWQ, GPTQ) as kiln.loaders.quantized combines them.
`WeightStore` maps HF-style tensor names ("model.layers.0.self_attn.q_proj.weight") to lazily loaded
tensors; it checks shapes and raises a ModelLoadError naming the file and tensor for anything missing
or mis-shaped.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kiln.models.config import ModelLoadError
from kiln.quant.gguf_blocks import (  # noqa: F401  (re-exported)
    BLOCK_BYTES,
    BLOCK_SIZE,
    KERNEL_QTYPES,
    GGUFStackedWeight,
    GGUFWeight,
)
from kiln.quant.linear_weights import (  # noqa: F401  (re-exported)
    QUANTIZED_WEIGHT_TYPES,
    BlockFP8Weight,
    Int4Weight,
    ScaledWeight,
    cat_quantized_rows,
)

# GGUF block constants under their model-side names (kiln.quant.gguf_blocks is the codec).
GGUF_BLOCK_BYTES = BLOCK_BYTES
GGUF_BLOCK_SIZE = BLOCK_SIZE


Weight = torch.Tensor | GGUFWeight | GGUFStackedWeight | ScaledWeight | BlockFP8Weight | Int4Weight


def weight_shape(weight: Weight) -> tuple[int, ...]:
    return tuple(weight.shape)


def cat_rows(weights: list[Weight], dtype: torch.dtype) -> Weight:
    """Stack matrices along the output dim (fused QKV, gate/up). GGUF blocks of one type stay blocks
    (Q4_0 next to Q4_1 becomes Q4_1, Q4_0 / Q5_0 next to Q8_0 become Q8_0: exact, as a Q4_K_M file of
    a model whose rows are not a multiple of 256 mixes them); other mixes of GGUF types keep their
    parts' blocks as one GGUFStackedWeight (a Q4_K_M file's Q4_K q / k beside a Q6_K v); quantized
    checkpoint weights stay quantized where their formats stack (kiln.quant.linear_weights.
    cat_quantized_rows: W8A8 rows with their per-channel scales, int4 groups, whole FP8 blocks); other
    mixes are dequantized to `dtype`."""
    if all(isinstance(w, QUANTIZED_WEIGHT_TYPES) for w in weights):
        stacked = cat_quantized_rows(weights)
        if stacked is not None:
            return stacked
    if all(isinstance(w, GGUFWeight) for w in weights):
        qtypes = {w.qtype for w in weights}
        if qtypes == {"Q4_0", "Q4_1"}:
            weights, qtypes = [w.as_q4_1() for w in weights], {"Q4_1"}
        elif len(qtypes) > 1 and qtypes <= {"Q4_0", "Q5_0", "Q8_0"}:  # small models' fallback types
            weights, qtypes = [w.as_q8_0() for w in weights], {"Q8_0"}
        if len(qtypes) == 1:
            data = torch.cat([w.data for w in weights], dim=0)
            return GGUFWeight(weights[0].qtype, data, (data.shape[0], weights[0].shape[1]))
        if qtypes <= set(KERNEL_QTYPES):
            return GGUFStackedWeight.stack(weights)
    dense = [
        w.dequantize(dtype)
        if isinstance(w, (GGUFWeight, GGUFStackedWeight, *QUANTIZED_WEIGHT_TYPES))
        else w.to(dtype)
        for w in weights
    ]
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

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """The shape `name` is stored with (for tensors whose shape the reader does not fix, such as a
        KV-cache scale: [], [1] or [num_kv_heads, 1, 1]); KeyError when it is not stored."""
        return tuple(self._loaders[name][0])

    def unread(self) -> list[str]:
        """The stored tensors no `get` has asked for (after a model is built: what it runs without)."""
        return [name for name in self._loaders if name not in self.used]

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
            weight = load()
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{self.source}: cannot read tensor {name!r} ({exc})") from exc
        # a dense tensor is a float one: integer or bool bytes would be converted to wrong values
        # (quantized weights come as their own classes, built from their integer tensors)
        if isinstance(weight, torch.Tensor) and not weight.is_floating_point():
            raise ModelLoadError(
                f"{self.source}: tensor {name!r} is {str(weight.dtype).removeprefix('torch.')}, expected a "
                "floating-point tensor (a quantized weight whose quantization_config does not cover it?)"
            )
        return weight

    def get_optional(self, name: str, shape: tuple[int, ...]) -> Weight | None:
        return self.get(name, shape) if name in self._loaders else None
