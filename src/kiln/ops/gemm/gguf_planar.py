"""GGUF weights repacked once, at load, into planes a GPU reads in whole sectors ("gguf_planar_<qtype>",
a prepared_linear layout on CUDA; the kernel: gguf_planar_triton.py).

The file's blocks interleave 2-byte scales with the quants (18, 20, 22, 34, 144, 176 or 210 bytes a
block): a kernel reading them straight loads bytes, not words (gguf_linear on an H200: 5-16 % of the
memory roofline at decode). Here each kind of field gets its own row-major plane, W standing for [N, K],
holding the values the file stores (kiln.quant.gguf_blocks.block_codes), nothing multiplied out:

    plane    dtype / shape                 holds
    qs       int32 [N, K / 8]              the low 4 bits of every weight, nibble i of word j = weight 8j + i
             (Q8_0: int8 [N, K])           (Q8_0: the signed values)
    qh       int32 [N, K / 32] (Q5_0,      bit 4 of weight 32j + i at bit i of word j (Q5_*); bits 4-5 of
             Q5_K), [N, K / 16] (Q6_K),    weight 16j + i at bits 2i, 2i + 1 (Q6_K)
             else [N, 0]
    scales   [N, K / G]                    per group of G = 32 weights (16 for Q6_K): float16 d, or the
                                           K-quants' sub-block scale sc (uint8; Q6_K int8)
    mins     [N, K / 32] (Q4_1, Q4_K,      float16 m (Q4_1), uint8 m (Q4_K, Q5_K)
             Q5_K), else [N, 0]
    supers   float16 [N, K / 256 * S]      the K-quants' super-block d and dmin (S = 2: Q4_K, Q5_K) or d
             (K-quants), else [N, 0]       (S = 1: Q6_K)

    w = (q - QUANT_OFFSET[qtype]) * scale + min, scale = d or d * sc, min = m or -(dmin * m)

The kernel forms d * sc and dmin * m in float32 as ggml does, where they are exact (an fp16 times a
6-bit or int8 integer), and q * scale is exact too (at most 24 significant bits), so the one rounding
left is the add, as in ggml: float32 decodes are bit-exact with `gguf.quants.dequantize` (tests/ops/
gemm/test_gguf_planar.py). Bits a weight, planes / file: Q4_0 4.5 / 4.5, Q4_1 5 / 5, Q5_0 5.5 / 5.5,
Q8_0 8.5 / 8.5, Q4_K 4.625 / 4.5, Q5_K 5.625 / 5.5, Q6_K 6.5625 / 6.5625 (the K-quants' 6-bit sc and m
take a byte each).
"""

from __future__ import annotations

import torch

from kiln.quant.gguf_blocks import (
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    KERNEL_QTYPES,
    QK_K,
    SUPER_VALUES,
    WITH_MINS,
    block_codes,
    decode_fields,
    group_scales,
    scale_group,
)

PLANAR_LAYOUTS = {f"gguf_planar_{qtype}": qtype for qtype in KERNEL_QTYPES}
HIGH_BITS = {"Q5_0": 1, "Q5_K": 1, "Q6_K": 2}  # bits of q above the low nibble (qh)
PACK_WEIGHTS = 1 << 22  # weights packed at once (pack_planar's working memory: ~100 MB)


def _words(fields: torch.Tensor, width: int) -> torch.Tensor:
    """int64 [N, K] of values below 2^width -> int32 [N, K * width / 32], field i of word j at bit
    i * width (the bit pattern of a uint32 word, kept as int32)."""
    per_word = 32 // width
    n = fields.shape[0]
    shifts = torch.arange(per_word, dtype=torch.int64) * width
    words = (fields.reshape(n, -1, per_word) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_planar(qweight: torch.Tensor, qtype: str) -> tuple[torch.Tensor, ...]:
    """GGUF blocks uint8 [N, row_bytes] (kiln.ops.gguf_linear's layout) -> (qs, qh, scales, mins,
    supers), the planes of the module docstring, on qweight's device."""
    if qtype not in KERNEL_QTYPES:
        raise ValueError(
            f"pack_planar: qtype {qtype!r} unsupported, expected one of {', '.join(KERNEL_QTYPES)}"
        )
    blocks = qweight.cpu()
    k = blocks.shape[1] // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
    if blocks.numel() == 0:  # no rows or no columns: planes of the right shapes, nothing to read
        shapes, dtypes = planar_shapes(blocks.shape[0], k, qtype), planar_dtypes(qtype)
        return tuple(
            torch.empty(s, dtype=d, device=qweight.device) for s, d in zip(shapes, dtypes, strict=True)
        )
    # a few rows at a time: the words are built in int64 (~26 bytes a weight at once)
    step = max(1, PACK_WEIGHTS // k)
    parts = [_pack_rows(blocks[i : i + step], qtype) for i in range(0, blocks.shape[0], step)]
    return tuple(torch.cat(planes).to(qweight.device) for planes in zip(*parts, strict=True))


def _pack_rows(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, ...]:
    q, scales, mins, supers = block_codes(blocks, qtype)
    n = q.shape[0]
    qs = q.to(torch.int8) if qtype == "Q8_0" else _words((q & 0xF).long(), 4)
    bits = HIGH_BITS.get(qtype, 0)
    qh = _words((q >> 4).long(), bits) if bits else torch.empty(n, 0, dtype=torch.int32)
    dtypes = planar_dtypes(qtype)
    mins = torch.empty(n, 0, dtype=dtypes[3]) if mins is None else mins
    supers = torch.empty(n, 0, dtype=dtypes[4]) if supers is None else supers
    return qs, qh, scales, mins, supers


def _unwords(words: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [N, W] -> int64 [N, W * 32 / width]: `_words` undone."""
    per_word = 32 // width
    shifts = torch.arange(per_word, dtype=torch.int64, device=words.device) * width
    fields = (words.long()[..., None] >> shifts) & ((1 << width) - 1)
    return fields.reshape(words.shape[0], -1)


def planar_matrix(
    tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], qtype: str, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The [N, K] matrix the planes stand for, computed in float64 (exact) or float32 (the kernel's
    arithmetic), returned in `dtype`."""
    qs, qh, scales, mins, supers = tensors
    q = qs.long() if qtype == "Q8_0" else _unwords(qs, 4)
    bits = HIGH_BITS.get(qtype, 0)
    if bits:
        q = q | (_unwords(qh, bits) << 4)
    scales, mins = group_scales(
        scales, mins if qtype in WITH_MINS else None, supers if qtype in SUPER_VALUES else None, qtype
    )
    return decode_fields(q, scales, mins, qtype, dtype)


def planar_shapes(N: int, K: int, qtype: str) -> tuple[tuple[int, int], ...]:
    """The shapes of (qs, qh, scales, mins, supers) for an [N, K] weight in qtype."""
    bits = HIGH_BITS.get(qtype, 0)
    qs = (N, K) if qtype == "Q8_0" else (N, K // 8)
    mins = (N, K // 32 if qtype in WITH_MINS else 0)
    supers = (N, K // QK_K * SUPER_VALUES.get(qtype, 0))
    return qs, (N, K * bits // 32), (N, K // scale_group(qtype)), mins, supers


def planar_dtypes(qtype: str) -> tuple[torch.dtype, ...]:
    """The dtypes of (qs, qh, scales, mins, supers) in qtype."""
    if qtype not in SUPER_VALUES:  # d (and m): the file's float16
        codes = torch.float16
    else:  # the K-quants' sub-block sc (and m)
        codes = torch.int8 if qtype == "Q6_K" else torch.uint8
    return (torch.int8 if qtype == "Q8_0" else torch.int32, torch.int32, codes, codes, torch.float16)


def planar_bytes(N: int, K: int, qtype: str) -> int:
    """Bytes of the planes of an [N, K] weight."""
    return sum(
        rows * cols * dtype.itemsize
        for (rows, cols), dtype in zip(planar_shapes(N, K, qtype), planar_dtypes(qtype), strict=True)
    )
