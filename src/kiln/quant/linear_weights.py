"""Quantized linear weights as a checkpoint hands them over, already in the layouts of Kiln's GEMMs.

The loaders convert a checkpoint's packing (compressed-tensors, block FP8, AWQ, GPTQ) into one of
these once, at load; `kiln.ops.gemm.weight_formats.prepare_linear_weight` then places it on the device.
Every class has `shape` ([out, in] = [N, K]), `dequantize(dtype)` (the float matrix it stands for),
`rows(index)` (output rows reordered / sliced, for fused projections and tensor parallelism).

    ScaledWeight     W8A8 ("fp8": e4m3fn, "int8"): data [N, K], scale float32 [N, 1] per output
                     channel (a per-tensor scale is expanded to every row at load: exact, and rows of
                     weights with different scales can then be stacked); input_scale float32 [1] for
                     a static per-tensor activation scale, None for dynamic per-token scales.
                     w = data * scale.                                      -> fp8_linear / int8_linear
    BlockFP8Weight   data e4m3fn [N, K], scale float32 [ceil(N / bn), ceil(K / bk)] per (bn x bk)
                     block; activations are quantized per token and per bk-group at run time.
                     w[n, k] = data[n, k] * scale[n // bn, k // bk].        -> fp8_block_linear
    Int4Weight       W4A16, int4_linear's layout (kiln.quant.int4): qweight int32 [N, ceil(K / 8)],
                     scales [N, G] float, zeros uint8 [N, G], group_size; perm int64 [K] or None: the
                     weight's inputs are stored permuted (GPTQ act-order sorted by group), so the
                     kernel reads x[:, perm]. w[:, perm] = dequantize_int4(qweight, scales, zeros).
    Sparse24Weight   2:4 sparse (kiln.quant.sparse24, `kiln sparsify`): values [N, K/2], meta uint8
                     [N, ceil(K/8)].                                        -> sparse24_linear
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kiln.quant.int4 import dequantize_int4
from kiln.quant.sparse24 import Sparse24Weight


@dataclass
class ScaledWeight:
    """A W8A8 weight (see the module docstring): qtype "fp8" or "int8"."""

    qtype: str
    data: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), int(self.data.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] data * scale, computed in float32 (float64 when asked for)."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.data.to(compute) * self.scale.to(compute)).to(dtype)

    def rows(self, index: torch.Tensor | slice) -> ScaledWeight:
        scale = self.scale[index] if self.scale.numel() > 1 else self.scale  # per channel, or per tensor
        return ScaledWeight(self.qtype, self.data[index].contiguous(), scale.contiguous(), self.input_scale)

    def cols(self, start: int, end: int) -> ScaledWeight:
        """Inputs [start, end): the scales are per output channel (or tensor), so all of them stay."""
        return ScaledWeight(self.qtype, self.data[:, start:end].contiguous(), self.scale, self.input_scale)


@dataclass
class BlockFP8Weight:
    """A block-scaled FP8 weight (see the module docstring); block = (bn, bk)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), int(self.data.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] data * (each element's block scale), computed in float32 (float64 when asked)."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        n, k = self.shape
        bn, bk = self.block
        scale = self.scale.to(compute).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return (self.data.to(compute) * scale).to(dtype)

    def rows(self, index: slice) -> BlockFP8Weight:
        """Rows [start, stop) of a slice; start must be a multiple of the block height (ValueError)."""
        start, stop, _ = index.indices(self.shape[0])
        bn = self.block[0]
        if start % bn:
            raise ValueError(f"BlockFP8Weight.rows: row {start} is not on a {bn}-row block boundary")
        return BlockFP8Weight(
            self.data[start:stop].contiguous(),
            self.scale[start // bn : -(-stop // bn)].contiguous(),
            self.block,
        )

    def cols(self, start: int, end: int) -> BlockFP8Weight:
        """Inputs [start, end); start and end must lie on block boundaries (end may be K), else
        ValueError: a block's scale covers bk inputs."""
        bk = self.block[1]
        if start % bk or (end % bk and end != self.shape[1]):
            raise ValueError(
                f"BlockFP8Weight.cols: inputs [{start}, {end}) do not lie on {bk}-input block boundaries"
            )
        return BlockFP8Weight(
            self.data[:, start:end].contiguous(),
            self.scale[:, start // bk : -(-end // bk)].contiguous(),
            self.block,
        )


@dataclass
class Int4Weight:
    """A W4A16 weight in int4_linear's layout (see the module docstring); K = in_features."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    in_features: int
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.qweight.shape[0]), self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in the checkpoint's input order (the permutation undone)."""
        w = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, self.in_features, dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def rows(self, index: torch.Tensor | slice) -> Int4Weight:
        return Int4Weight(
            self.qweight[index].contiguous(),
            self.scales[index].contiguous(),
            self.zeros[index].contiguous(),
            self.group_size,
            self.in_features,
            self.perm,
        )

    def cols(self, start: int, end: int) -> Int4Weight:
        """Inputs [start, end) with their groups' scales and zero points: start and end on group
        boundaries (end may be K), else ValueError. Act-order weights (perm) cannot be split along
        their inputs (a group mixes inputs from the whole row): ValueError."""
        if self.perm is not None:
            raise ValueError(
                "Int4Weight.cols: an act-order (g_idx) weight cannot be split along its inputs; "
                "use a checkpoint quantized without desc_act, or no tensor parallelism"
            )
        gs = self.group_size
        if start % gs or (end % gs and end != self.in_features):
            raise ValueError(
                f"Int4Weight.cols: inputs [{start}, {end}) must start and end on multiples of its "
                f"group_size {gs} (or K={self.in_features})"
            )
        g0, g1 = start // gs, -(-end // gs)
        words = self.qweight[:, start // 8 : -(-end // 8)].contiguous()  # group_size is a multiple of 8
        return Int4Weight(
            words, self.scales[:, g0:g1].contiguous(), self.zeros[:, g0:g1].contiguous(), gs, end - start
        )


QUANTIZED_WEIGHT_TYPES = (ScaledWeight, BlockFP8Weight, Int4Weight, Sparse24Weight)


def cat_quantized_rows(
    weights: list,
) -> ScaledWeight | BlockFP8Weight | Int4Weight | Sparse24Weight | None:
    """Stack quantized weights along N (fused QKV, gate/up) when their formats allow it, else None
    (the caller dequantizes). ScaledWeights of one qtype: rows and per-channel scales stack; static
    input scales must agree (q/k/v read the same input, so calibration gives them one scale; the
    largest is taken otherwise, which never clips). BlockFP8Weights: one block size, every part but
    the last a whole number of block rows. Int4Weights: one group size and the same permutation.
    Sparse24Weights (2:4, kiln.quant.sparse24): kept values and positions stack row-wise."""
    first = weights[0]
    if not all(type(w) is type(first) for w in weights):
        return None
    if isinstance(first, Sparse24Weight):
        dtype = functools.reduce(torch.promote_types, [w.values.dtype for w in weights])
        return Sparse24Weight(
            torch.cat([w.values.to(dtype) for w in weights]), torch.cat([w.meta for w in weights])
        )
    if isinstance(first, ScaledWeight):
        if any(
            w.qtype != first.qtype or (w.input_scale is None) != (first.input_scale is None) for w in weights
        ):
            return None
        input_scale = None
        if first.input_scale is not None:
            input_scale = torch.stack([w.input_scale.reshape(()) for w in weights]).amax().reshape(1)
        return ScaledWeight(
            first.qtype,
            torch.cat([w.data for w in weights]),
            torch.cat([w.scale for w in weights]),
            input_scale,
        )
    if isinstance(first, BlockFP8Weight):
        bn = first.block[0]
        if any(w.block != first.block for w in weights) or any(w.shape[0] % bn for w in weights[:-1]):
            return None
        return BlockFP8Weight(
            torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]), first.block
        )
    same_perm = all(
        (w.perm is None and first.perm is None)
        or (w.perm is not None and first.perm is not None and torch.equal(w.perm, first.perm))
        for w in weights
    )
    if not same_perm or any(w.group_size != first.group_size for w in weights):
        return None
    scale_dtype = functools.reduce(torch.promote_types, [w.scales.dtype for w in weights])
    return Int4Weight(
        torch.cat([w.qweight for w in weights]),
        torch.cat([w.scales.to(scale_dtype) for w in weights]),
        torch.cat([w.zeros for w in weights]),
        first.group_size,
        first.in_features,
        first.perm,
    )


def int4_weight(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> Int4Weight:
    """An Int4Weight from unpacked codes q [N, K] (0..15), per-group scales [N, G] and zero points
    [N, G] (w = (q - zero) * scale); group_size -1 = one group per row. int4_linear takes groups of
    32, 64 or 128: a group of a multiple of 128 (or a whole row) is split into groups of 128 with the
    same scale and zero point, which is exact. Other sizes raise ValueError."""
    from kiln.quant.int4 import GROUP_SIZES, pack_int4

    n, k = q.shape
    if group_size == -1:
        group_size = max(k, 1)
    if group_size not in GROUP_SIZES:
        if group_size % 128 and group_size != k:
            raise ValueError(
                f"group_size {group_size}: int4_linear takes groups of {GROUP_SIZES} (or multiples of 128, "
                "or one group per row, which are split into groups of 128)"
            )
        # group g of size group_size covers kernel groups g * (group_size / 128) ...: expand per input
        per_input = torch.arange(k) // group_size
        starts = torch.arange(0, k, 128)
        scales, zeros = scales[:, per_input[starts]], zeros[:, per_input[starts]]
        group_size = 128
    return Int4Weight(
        pack_int4(q), scales.contiguous(), zeros.to(torch.uint8).contiguous(), group_size, k, perm
    )
