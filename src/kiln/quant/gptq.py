"""GPTQ checkpoints (AutoGPTQ / GPTQModel, config `quant_method: "gptq"`, 4 bits) -> int4_linear's
layout, once, at load. GPTQ's own packers need a GPU, so this layout is checked by known-answer
tests on the documented bit layout (tests/quant/test_awq_gptq.py).

A Linear with in_features K, out_features N and group size g stores, in the [in, out] orientation:
    qweight int32 [K / 8, N]   packed along K: nibble i of word (j, n) is q[8j + i, n]
    qzeros  int32 [G, N / 8]   packed along N: nibble i of word (g, j) is the stored zero of column
                               8j + i
    scales  fp16  [G, N]
    g_idx   int32 [K]          the group of each input (act-order / desc_act: not k // g)
    w[k, n] = (q[k, n] - zero[g_idx[k], n]) * s[g_idx[k], n]
The "gptq" checkpoint format (v1, what AutoGPTQ writes) stores zero - 1 (zero = stored + 1; a
symmetric 4-bit weight stores 7), "gptq_v2" stores the zero itself.
Act-order: inputs are sorted by group (a stable argsort of g_idx, `perm`); the weight is stored in
that order, where every group is contiguous, and the kernel reads x[:, perm] (one gather of the
activations per call, cheaper than dequantizing).
"""

from __future__ import annotations

import torch

from kiln.quant.int4 import pack_int4, unpack_int4
from kiln.quant.linear_weights import Int4Weight, int4_weight


def unpack_gptq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N] -> int32 [N, K] values 0..15 (the transposed words are kiln.quant.int4's)."""
    return unpack_int4(qweight.T.contiguous(), qweight.shape[0] * 8).to(torch.int32)


def pack_gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] values 0..15 (K a multiple of 8) -> int32 [K / 8, N] (what GPTQ's packer writes)."""
    return pack_int4(q).T.contiguous()


def unpack_gptq_qzeros(qzeros: torch.Tensor) -> torch.Tensor:
    """int32 [G, N / 8] -> int32 [G, N] stored zeros 0..15."""
    return unpack_int4(qzeros, qzeros.shape[1] * 8).to(torch.int32)


def gptq_to_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    *,
    zeros_plus_one: bool = True,
) -> Int4Weight:
    """GPTQ tensors (above) -> Int4Weight [N, K]; zeros_plus_one: the v1 format's stored zero - 1.
    ValueError on shapes that do not agree or a g_idx whose groups are not all group_size long."""
    words, n = qweight.shape
    k = words * 8
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight / qzeros: {qweight.dtype} / {qzeros.dtype}, expected int32")
    for name, t, shape in (("qzeros", qzeros, (groups, -(-n // 8))), ("scales", scales, (groups, n))):
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name}: shape {tuple(t.shape)}, expected {shape} for qweight {tuple(qweight.shape)}"
            )
    q = unpack_gptq_qweight(qweight)  # [N, K]
    zeros = (unpack_gptq_qzeros(qzeros)[:, :n] + (1 if zeros_plus_one else 0)).T.contiguous()  # [N, G]
    scales = scales.T.contiguous()
    perm = act_order_perm(g_idx, k, gs) if g_idx is not None else None
    if perm is not None:
        q = q[:, perm]
    return int4_weight(q, scales, zeros, gs if group_size != -1 else -1, perm)


def act_order_perm(g_idx: torch.Tensor, k: int, group_size: int) -> torch.Tensor | None:
    """The input order in which an act-order weight's groups are contiguous: a stable argsort of g_idx
    (int [K], input k's group), or None where g_idx is the plain k // group_size. ValueError for a
    g_idx of another length, out of range, or with groups other than group_size long (the last may be
    shorter)."""
    groups = -(-k // group_size)
    g_idx = g_idx.to(torch.int64)
    if tuple(g_idx.shape) != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"g_idx: shape {tuple(g_idx.shape)}, expected ({k},) of groups 0..{groups - 1}")
    if torch.equal(g_idx, torch.arange(k) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=groups)
    if not bool((counts[:-1] == group_size).all()):
        raise ValueError(f"g_idx: groups of {counts.tolist()} inputs, expected {group_size} each (act-order)")
    return torch.sort(g_idx, stable=True).indices
