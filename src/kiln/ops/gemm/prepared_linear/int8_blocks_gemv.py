"""The one-row kernel of the "q8_blocks_onednn", "int8_blocks_onednn" and "q8_blocks_mins_onednn"
layouts: y = x @ W^T with W = d * q stored as GGUF Q8_0's int8 values q [N, K] and float32 scales
d [N, K / 32] (Q6_K's per 16; W = d * q + m with Q5_K's mins m [N, K / 32] too, or a stacked weight's
per 16 or 32 as its scales), computed in float32 on those values.

Kiln's native kernel runs it (kiln.ops.gemm.cpu_q8_blocks, loaded when the weight was packed). Where
that library cannot be built, PyTorch has no CPU kernel for int8 weights with a scale per 32
(`_weight_int8pack_mm` takes one per row), so the same sum is written as tensor code and compiled by
inductor into one C++ loop that reads each weight byte once. Eager calls run it through
`torch.compile` (one graph per weight shape, static: inductor's dynamic-shape code of it is ~2x
slower); inside the engine's compiled decode step it is traced into the step's graph (calling the
compiled function there would break the graph).

Traced into a larger graph, inductor would fuse a pointwise producer of x into this loop and recompute
it once per output row (a final RMSNorm: 2x slower); there x passes through `kiln.ops.realize.realized`.
"""

from __future__ import annotations

import functools

import torch

from kiln.ops.cpu_inductor import compile_cpu
from kiln.ops.gemm import cpu_q8_blocks
from kiln.ops.realize import realized


def _gemv(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mins=None) -> torch.Tensor:
    n, k = values.shape
    groups = scales.shape[1]  # blocks of 32 (Q8_0) or 16 (Q6_K)
    xs = x.float().view(1, groups, k // groups)
    products = xs * values.view(n, groups, k // groups).float() * scales.view(n, groups, 1)
    y = products.sum((-1, -2))
    if mins is not None:  # each block's sum of x times its min
        y = y + (xs.sum(-1) * mins).sum(-1)
    return y.view(1, n)


@functools.cache
def _compiled_gemv():
    # Not fullgraph: past dynamo's recompile limit (8 weight shapes in one process: the verifier's fuzz
    # cases, not an engine, which has one LM head) fullgraph would raise; this runs _gemv eagerly instead.
    return compile_cpu(_gemv, dynamic=False)


def int8_blocks_gemv(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """x [1, K] float (any float dtype, read as float32), values int8 [N, K], scales float32 [N, K / B]
    (B = 32, or 16 for Q6_K's), mins float32 [N, K / B] or None -> y float32 [1, N],
    y[n] = sum_k x[k] * (scales[n, k // B] * values[n, k] + mins[n, k // B]) (no min term without mins)."""
    if cpu_q8_blocks.loaded():
        return cpu_q8_blocks.q8_blocks_gemv(x.float(), values, scales, mins)
    if torch.compiler.is_compiling():  # traced into the caller's graph
        return _gemv(realized(x.float()), values, scales, mins)
    # float32 first: one graph per shape, not per dtype
    return _compiled_gemv()(x.float(), values, scales, mins)
