"""Which 2:4 GEMM a prepared sparse weight runs on CUDA: Kiln's `sparse24_linear` (expands the weight in
registers: reads 9/16 of the fp16 bytes, the win at decode) or PyTorch's semi-structured sparse tensor
(cuSPARSELt / CUTLASS on the sparse tensor cores: the win once enough rows make the GEMM compute-bound).

The crossover is measured, not guessed: for a weight of N x K in fp16/bf16 on this GPU, both GEMMs are
timed at CANDIDATE_ROWS rows, and the crossover is the fewest rows from which the semi-structured GEMM is
faster at every larger count timed (None when it never is, or when PyTorch cannot build one for this
shape or GPU). The result is cached in Kiln's tuning cache (op "sparse24_dispatch", keyed by GPU, Triton
version, dtype and N/K buckets), so one load times each shape once per machine.

`KILN_SPARSE24_DISPATCH=auto|triton|semi_structured` overrides it (auto by default): benchmarks force
one side.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from kiln.ops import tuned_configs

logger = logging.getLogger(__name__)

CACHE_OP = "sparse24_dispatch"
CANDIDATE_ROWS = (16, 64, 256, 1024, 4096)
DISPATCH_MODES = ("auto", "triton", "semi_structured")
REPEATS = 10


def dispatch_mode() -> str:
    """KILN_SPARSE24_DISPATCH, checked: "auto" (measured crossover), "triton" or "semi_structured"."""
    mode = os.environ.get("KILN_SPARSE24_DISPATCH", "auto") or "auto"
    if mode not in DISPATCH_MODES:
        raise ValueError(f"KILN_SPARSE24_DISPATCH={mode!r}, expected one of {', '.join(DISPATCH_MODES)}")
    return mode


def crossover_from_timings(seconds: dict[int, tuple[float, float]]) -> int | None:
    """{rows: (sparse24_linear seconds, semi-structured seconds)} -> the fewest rows from which the
    semi-structured GEMM is faster at every larger row count timed, or None."""
    crossover = None
    for rows in sorted(seconds, reverse=True):
        kiln_s, semi_s = seconds[rows]
        if semi_s >= kiln_s:
            break
        crossover = rows
    return crossover


def _cuda_seconds(fn: Callable[[], object]) -> float:
    fn()  # warm-up: compiles, selects the cuSPARSELt algorithm
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def to_semi_structured(dense: torch.Tensor) -> torch.Tensor | None:
    """PyTorch's semi-structured sparse copy of a 2:4 weight [N, K] (CUDA, fp16/bf16), or None where
    PyTorch cannot build one (shape, GPU, missing cuSPARSELt/CUTLASS); the reason is logged."""
    try:
        from torch.sparse import to_sparse_semi_structured

        return to_sparse_semi_structured(dense)
    except (RuntimeError, ValueError, NotImplementedError, ImportError) as exc:
        logger.info("2:4 weight %s: no semi-structured sparse tensor (%s)", tuple(dense.shape), exc)
        return None


def measure_crossover(
    values: torch.Tensor,
    meta: torch.Tensor,
    semi: torch.Tensor,
    seconds: Callable[[Callable[[], object]], float] = _cuda_seconds,
) -> int | None:
    """Time `sparse24_linear(x, values, meta)` against `x @ semi^T` at CANDIDATE_ROWS rows of random x
    (values' dtype and device) and return crossover_from_timings of them."""
    from kiln.ops.gemm.sparse24_linear import sparse24_linear

    K = values.shape[1] * 2
    timings = {}
    for rows in CANDIDATE_ROWS:
        x = torch.randn(rows, K, dtype=values.dtype, device=values.device)
        timings[rows] = (
            seconds(lambda x=x: sparse24_linear(x, values, meta)),
            seconds(lambda x=x: torch.nn.functional.linear(x, semi)),
        )
    crossover = crossover_from_timings(timings)
    logger.info(
        "2:4 dispatch N=%d K=%d %s: %s -> crossover %s",
        values.shape[0],
        K,
        values.dtype,
        ", ".join(f"M={m} {1e6 * a:.0f}/{1e6 * b:.0f} us" for m, (a, b) in timings.items()),
        crossover,
    )
    return crossover


def cached_crossover(
    values: torch.Tensor,
    meta: torch.Tensor,
    build_semi: Callable[[], torch.Tensor | None],
    seconds: Callable[[Callable[[], object]], float] = _cuda_seconds,
) -> int | None:
    """measure_crossover for this weight's shape, dtype and device, read from / stored in the tuning
    cache (an unreadable cache is re-timed, with a warning in the log). `build_semi()` gives the
    semi-structured copy to time against (None where PyTorch cannot build one: no crossover); it is
    called only when the cache has no entry, so a cached load builds nothing here."""
    shape = {"N": int(values.shape[0]), "K": int(values.shape[1] * 2)}
    try:
        cached = tuned_configs.lookup(CACHE_OP, values.dtype, shape, device=values.device)
    except ValueError as exc:
        logger.warning("2:4 dispatch: ignoring the tuning cache (%s)", exc)
        cached = None
    if cached is not None and "crossover" in cached:
        return cached["crossover"] or None
    semi = build_semi()
    crossover = None if semi is None else measure_crossover(values, meta, semi, seconds)
    try:
        config = {"crossover": crossover or 0}
        tuned_configs.store(CACHE_OP, values.dtype, shape, config, device=values.device)
    except (ValueError, OSError) as exc:
        logger.warning("2:4 dispatch: could not cache the crossover (%s)", exc)
    return crossover


def prepare_sparse24_dispatch(values: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Extra tensors of a prepared "sparse24" layout on CUDA: (semi-structured weight, crossover rows as
    a 0-d int64 CPU tensor) when the semi-structured GEMM wins from some batch size on, else ().
    Empty on the CPU and for float32 (PyTorch's semi-structured GEMM takes fp16/bf16). The
    semi-structured copy is built only when it is timed or used."""
    mode = dispatch_mode()
    half = values.dtype in (torch.float16, torch.bfloat16)
    if values.device.type != "cuda" or not half or mode == "triton":
        return ()
    from kiln.quant.sparse24 import decompress_24

    built: list[torch.Tensor | None] = []

    def build_semi() -> torch.Tensor | None:
        built.append(to_semi_structured(decompress_24(values, meta)))
        return built[-1]

    crossover = 1 if mode == "semi_structured" else cached_crossover(values, meta, build_semi)
    if crossover is None:
        return ()
    semi = built[-1] if built else build_semi()
    return () if semi is None else (semi, torch.tensor(crossover))


def use_semi_structured(x: torch.Tensor, extra: tuple[torch.Tensor, ...]) -> bool:
    """Whether a prepared 2:4 weight with `extra` (prepare_sparse24_dispatch's) runs x on the
    semi-structured GEMM: it has one and x has at least the crossover's rows."""
    if not extra:
        return False
    rows = x.numel() // x.shape[-1]
    return rows >= int(extra[1])
