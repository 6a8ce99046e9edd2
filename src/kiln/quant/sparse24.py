"""2:4 structured sparsity: pruning a weight to two non-zeros in every four, and Kiln's compressed layout.

A weight W [N, K] (the checkpoint's [out, in]) is 2:4 sparse when each group of four consecutive
weights along K, W[n, 4g : 4g + 4], holds at most two non-zeros. It is stored as

    values: [N, K / 2] in the weight's dtype: values[n, 2g + j] = W[n, 4g + idx_j(n, g)], j = 0, 1
    meta:   uint8 [N, ceil(K / 8)]: group g's two positions idx_0 < idx_1 (each 0..3) as the nibble
            idx_0 | idx_1 << 2, group 2b in bits 0-3 of byte b and group 2b + 1 in bits 4-7 (the high
            nibble of the last byte is 0 when K / 4 is odd)

K must be a multiple of 4. A group with fewer than two non-zeros stores zeros at unused positions, so
every nibble names two distinct positions. fp16 values plus metadata take 9/16 of the dense fp16 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 4


def _check_weight(name: str, weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight has shape {tuple(weight.shape)}, expected 2-D [N, K]")
    if weight.shape[1] % GROUP:
        raise ValueError(f"{name}: weight has K={weight.shape[1]} columns, expected a multiple of 4 for 2:4")
    if not weight.is_floating_point():
        raise ValueError(f"{name}: weight dtype {weight.dtype} is not a float dtype")


def prune_24(weight: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the two largest `scores` of every group of four along K, zero the rest.

    weight: float [N, K], K % 4 == 0. scores: [N, K] importance (default |weight|: magnitude pruning;
    Wanda passes |weight| * the input activations' L2 norm per column, see `wanda_scores`).
    Returns a tensor like `weight` with exactly two kept positions per group (ties go to the lower
    position)."""
    _check_weight("prune_24", weight)
    if scores is None:
        scores = weight.abs()
    if tuple(scores.shape) != tuple(weight.shape):
        raise ValueError(f"prune_24: scores have shape {tuple(scores.shape)}, expected {tuple(weight.shape)}")
    N, K = weight.shape
    grouped = scores.reshape(N, K // GROUP, GROUP).float()
    keep = torch.zeros_like(grouped, dtype=torch.bool)
    keep.scatter_(2, _top2(grouped), True)
    return weight * keep.reshape(N, K)


def wanda_scores(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """Wanda's importance |W[n, k]| * ||X[:, k]||_2. weight [N, K]; input_norm [K], the L2 norm of
    the layer's input column k over the calibration tokens."""
    if input_norm.shape != (weight.shape[1],):
        raise ValueError(
            f"wanda_scores: input_norm has shape {tuple(input_norm.shape)}, expected [{weight.shape[1]}]"
        )
    return weight.abs().float() * input_norm.float().reshape(1, -1)


def _top2(grouped: torch.Tensor) -> torch.Tensor:
    """[N, G, 4] keys -> int64 [N, G, 2] positions of the two largest, ties to the lower position."""
    return grouped.sort(dim=2, descending=True, stable=True).indices[..., :2]


def is_24_sparse(weight: torch.Tensor) -> bool:
    """True when every group of four along K holds at most two non-zeros."""
    _check_weight("is_24_sparse", weight)
    N, K = weight.shape
    return bool(((weight.reshape(N, K // GROUP, GROUP) != 0).sum(2) <= 2).all())


def compress_24(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2:4 sparse weight [N, K] -> (values [N, K/2] in its dtype, meta uint8 [N, ceil(K/8)]).

    Raises ValueError naming the first row and group with more than two non-zeros."""
    _check_weight("compress_24", weight)
    N, K = weight.shape
    G = K // GROUP
    grouped = weight.reshape(N, G, GROUP)
    nonzero = grouped != 0
    counts = nonzero.sum(2)
    if (counts > 2).any():
        n, g = (counts > 2).nonzero()[0].tolist()
        raise ValueError(
            f"compress_24: row {n}, group {g} (columns {4 * g}..{4 * g + 3}) has {int(counts[n, g])} "
            "non-zeros, expected at most 2 (prune with kiln.quant.sparse24.prune_24 first)"
        )
    # non-zeros first, then the lowest free positions; the two kept positions sorted ascending
    idx = _top2(nonzero.float()).sort(dim=2).values
    values = grouped.gather(2, idx).reshape(N, K // 2)
    nibbles = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.uint8)  # [N, G]
    if G % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(N, 1)], dim=1)
    meta = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return values.contiguous(), meta.contiguous()


def positions_24(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The kept positions int64 [N, K/4, 2] that `meta` encodes for `values` [N, K/2]; ValueError for
    mismatched shapes or a corrupt group (equal or descending positions)."""
    N, half = values.shape
    K = 2 * half
    if K % GROUP:
        raise ValueError(f"decompress_24: values have {half} columns, expected K/2 with K a multiple of 4")
    if meta.dtype != torch.uint8 or tuple(meta.shape) != (N, -(-K // 8)):
        raise ValueError(
            f"decompress_24: meta is {meta.dtype} {tuple(meta.shape)}, expected uint8 [{N}, {-(-K // 8)}]"
        )
    G = K // GROUP
    nibbles = torch.stack([meta & 0xF, meta >> 4], dim=2).reshape(N, 2 * meta.shape[1])[:, :G].long()
    idx = torch.stack([nibbles & 3, nibbles >> 2], dim=2)  # [N, G, 2]
    if (idx[..., 0] >= idx[..., 1]).any():
        raise ValueError("decompress_24: meta names the same or descending positions in a group (corrupt)")
    return idx


def decompress_24(values: torch.Tensor, meta: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(values [N, K/2], meta uint8 [N, ceil(K/8)]) -> the dense [N, K] weight in `dtype` (default
    values' dtype); exact."""
    idx = positions_24(values, meta)
    N, G = idx.shape[:2]
    dense = torch.zeros(N, G, GROUP, dtype=dtype or values.dtype, device=values.device)
    dense.scatter_(2, idx, values.reshape(N, G, 2).to(dense.dtype))
    return dense.reshape(N, G * GROUP)


@dataclass
class Sparse24Weight:
    """A 2:4 sparse [N, K] weight in sparse24_linear's layout (the module docstring), as a checkpoint
    written by `kiln sparsify` hands it over: values [N, K/2], meta uint8 [N, ceil(K/8)]."""

    values: torch.Tensor
    meta: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.values.shape[0]), 2 * int(self.values.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] matrix (exact)."""
        return decompress_24(self.values, self.meta, dtype)

    def rows(self, index: torch.Tensor | slice) -> Sparse24Weight:
        return Sparse24Weight(self.values[index].contiguous(), self.meta[index].contiguous())

    def cols(self, start: int, end: int) -> Sparse24Weight:
        """Inputs [start, end): start and end multiples of 8 (a meta byte holds two groups of four;
        end may be K), else ValueError."""
        if start % 8 or (end % 8 and end != self.shape[1]):
            raise ValueError(f"Sparse24Weight.cols: inputs [{start}, {end}) are not on 8-input boundaries")
        return Sparse24Weight(
            self.values[:, start // 2 : end // 2].contiguous(),
            self.meta[:, start // 8 : -(-end // 8)].contiguous(),
        )

    def to(self, dtype: torch.dtype) -> Sparse24Weight:
        """The kept values in `dtype` (the positions are unchanged)."""
        return Sparse24Weight(self.values.to(dtype), self.meta)
