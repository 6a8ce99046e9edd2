"""Which launches the sm_90 AOT sweep compiles, and its CLI (`kiln tune aot`, `python -m kiln.tune.aot`).

Every registered op with a Triton implementation ("triton", "triton_tma", and "triton_*" baselines
such as the pointer GEMM) is called on CPU tensors made by its spec's input maker, for each shape of
its bench suite ("llm": Llama-3-8B GEMMs, M in {1, 16, 64, 256, 2048, 8192}, ...), a few of its
fuzz shapes and the shapes the engine gives it for the `random:llama3-8b` and `random:tiny` models
(`model_shapes`; an fp8 cache's attention also with the exact positions the engine keeps by
default), in every dtype the op takes, with the config the launcher picks itself (tuning cache,
else heuristics), while `kiln.tune.aot.record.record_launches` records the launches. Each distinct launch is
then compiled for sm_90.

Large random inputs are not random here: `torch.randn`/`rand` of more than 1M elements give a constant
tensor (a launch depends on shapes, strides, alignment and dtypes, not values), which keeps an 8-expert
Mixtral MoE input under a second to make. Likewise a CPU matrix product of more than BIG_MATMUL
multiply-adds that a launcher runs around its kernels (fused_linear_cross_entropy's logits and
gradients: ~60 G multiply-adds in bf16 at its bench shape, minutes on a CPU without bf16 arithmetic)
returns a constant of its result's shape, dtype and layout instead of being computed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from kiln.tune.aot.record import CompileResult, LaunchRecorder, LaunchSpec, compile_spec, record_launches

aten = torch.ops.aten

QUICK_MAX_BYTES = 1 << 30
BIG_RANDOM = 1 << 20  # elements: larger random inputs are made constant (see the module docstring)
BIG_MATMUL = 1 << 27  # multiply-adds: larger CPU matrix products return a constant (ditto)


@dataclass
class DriveError:
    """A case whose launcher raised before or between its launches (its Python side, not a compile)."""

    source: str
    error: str


# Ops whose "triton" implementation launches no kernel of its own but other ops': prepared_linear hands
# its CUDA layouts to linear / gguf_linear (swept directly), and its inputs made here are CPU layouts;
# its own kernel, the GGUF planes' GEMM, is driven on planes packed from the same GGUF blocks.
DELEGATING_OPS = ("prepared_linear",)


def _gguf_planar_driver(x, layout, weight, bias=None, out_dtype=None):
    """prepared_linear's CUDA GGUF path ("gguf_planar_*") for an input made from GGUF blocks."""
    from kiln.ops.gemm.gguf_planar import pack_planar
    from kiln.ops.gemm.gguf_planar_triton import gguf_planar_linear_triton
    from kiln.ops.gemm.prepared_linear.spec import gguf_source

    source = gguf_source(weight)
    if source is None:
        return None  # a float source: the "dense" layout on CUDA, i.e. linear's kernels
    blocks, qtype = source
    bias = None if bias is None else bias.to(x.dtype)
    return gguf_planar_linear_triton(x, pack_planar(blocks, qtype), qtype, bias)


def triton_backends(spec) -> dict:
    """name -> callable: the op's Triton implementations and its Triton baselines."""
    if spec.name == "prepared_linear":
        return {"triton_gguf_planar": _gguf_planar_driver}
    if spec.name in DELEGATING_OPS:
        return {}
    backends = {name: impl.fn for name, impl in spec.implementations.items() if name.startswith("triton")}
    backends.update({name: fn for name, fn in spec.baselines.items() if name.startswith("triton")})
    return backends


def sweep_cases(op_names: list[str] | None, suite: str, fuzz: int, quick: bool) -> Iterator[tuple]:
    """(spec, {backend name: fn}, shape, dtype, kind) for every launch case, kind "bench", "fuzz" or
    "model" (the shape's origin; fuzz shapes are odd sizes no model has); `quick` keeps each op's first
    and last suite shape, every fuzz shape (their edge cases pick other constexpr paths: fp8_block_linear's
    block_k=16 did not compile for sm_90 and only its 4th fuzz shape has it), only bf16 and the dtypes
    bf16 does not cover (fp8), and
    only cases whose byte model (`OpSpec.bytes`) is under QUICK_MAX_BYTES (cheap inputs to make)."""
    from kiln.ops import all_ops
    from kiln.ops.attention.validate import FP8_DTYPES

    registry = all_ops()
    unknown = [name for name in op_names or [] if name not in registry]
    if unknown:
        raise ValueError(f"kiln.tune.aot: unknown op(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    for name in op_names or list(registry):
        spec = registry[name]
        backends = triton_backends(spec)
        if not backends:
            continue
        bench = list(spec.bench_shapes.get(suite, []))
        if quick and len(bench) > 2:
            bench = [bench[0], bench[-1]]
        shapes = [(shape, "bench") for shape in bench]
        shapes += [(shape, "fuzz") for shape in spec.fuzz_shapes(random.Random(0))[: None if quick else fuzz]]
        for preset in ("tiny",) if quick else MODEL_PRESETS:
            for shape in model_shapes(preset, quick).get(name, []):
                if shape not in bench:
                    shapes.append((shape, "model"))
        dtypes = list(spec.dtypes)
        if quick:
            dtypes = [d for d in dtypes if d is torch.bfloat16 or d.is_floating_point and d.itemsize == 1]
        for dtype in dtypes:
            for shape, kind in shapes:
                if quick and spec.bytes(shape, dtype) > QUICK_MAX_BYTES:
                    continue
                if kind == "model" and "exact_window" in shape and dtype not in FP8_DTYPES:
                    continue  # exact positions are an fp8 cache's: the plain model shape's launches again
                yield spec, backends, shape, dtype, kind


MODEL_PRESETS = ("llama3-8b", "tiny")
ENGINE_BLOCK_SIZE = 16  # EngineConfig's default KV block size
ENGINE_EXACT_WINDOW = 32  # EngineConfig's default kv_cache_exact_window (exact positions of an fp8 cache)


def model_shapes(preset_name: str, quick: bool = False) -> dict[str, list[dict]]:
    """op name -> the shapes one decoder layer (and the LM head) of a `random:<preset>` model gives
    that op in the engine: the projections, norms, rotary, KV-cache writes and attention for decode
    batches and prefill chunks. A stand-in for running the model, whose layers take the Triton path
    only for CUDA tensors."""
    from kiln.loaders.random_weights import PRESETS

    p = PRESETS[preset_name]
    hidden, heads, kv, d = p.hidden_size, p.num_heads, p.num_kv_heads, p.head_dim
    tokens = (1, 64) if quick else (1, 16, 64, 256, 2048, 8192)
    gemms = [((heads + 2 * kv) * d, hidden), (hidden, heads * d), (hidden, p.intermediate_size)]
    gemms.append((p.vocab_size, hidden))  # LM head
    attn = {"num_heads": heads, "num_kv_heads": kv, "head_dim": d, "block_size": ENGINE_BLOCK_SIZE}
    shapes: dict[str, list[dict]] = {
        "linear": [{"M": m, "N": n, "K": k, "bias": False} for n, k in gemms for m in tokens],
        "linear_silu_mul": [{"M": m, "N": p.intermediate_size, "K": hidden} for m in tokens],
        "rms_norm": [{"rows": m, "hidden": hidden, "residual": r} for m in tokens for r in (False, True)],
        "rotary_embedding": [
            {"tokens": m, "q_heads": heads, "kv_heads": kv, "head_dim": d, "max_position": 8192}
            for m in tokens
        ],
        "write_kv_cache": [
            {
                "num_tokens": m,
                "num_kv_heads": kv,
                "head_dim": d,
                "num_blocks": max(64, 2 * m // 16),
                "block_size": ENGINE_BLOCK_SIZE,
            }
            for m in tokens
        ],
        "paged_decode_attention": [
            {"batch": b, "context": c, **attn}
            for b in ((1, 64) if quick else (1, 16, 64))
            for c in (512, 4096)
        ],
        "paged_prefill_attention": [
            {"batch": 1, "seqlen_q": q, "context": q, **attn} for q in ((64,) if quick else (16, 512, 2048))
        ],
    }
    # An fp8 cache keeps exact positions by default: the same attention shapes again with exact caches
    # (the input makers honour exact_window for fp8 only; sweep_cases drives these for fp8 alone).
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        shapes[name] += [{**shape, "exact_window": ENGINE_EXACT_WINDOW} for shape in shapes[name]]
    return shapes


@contextlib.contextmanager
def _cheap_big_random() -> Iterator[None]:
    real = {name: getattr(torch, name) for name in ("randn", "rand")}

    def constant(name):
        def make(*size, generator=None, **kwargs):
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            if int(torch.Size(dims).numel()) <= BIG_RANDOM:
                return real[name](*size, generator=generator, **kwargs)
            # a constant, not torch.empty: uninitialised memory can hold NaN/inf, which the specs'
            # input builders (2:4 pruning, quantizers) rightly reject
            return torch.full(tuple(dims), 0.25, **kwargs)

        return make

    for name in real:
        setattr(torch, name, constant(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)


class _CheapBigMatmuls(TorchDispatchMode):
    """Matrix products of more than BIG_MATMUL multiply-adds return a constant 0.25 tensor of their
    result's shape, dtype and strides (found by running the op on meta tensors); the rest run."""

    OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2][-2:]
            a, b = operands
            if a.shape[:-1].numel() * a.shape[-1] * b.shape[-1] > BIG_MATMUL:
                meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
                out = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=a.device)
                return out.fill_(0.25)
        return func(*args, **kwargs)


def _to_meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def record_sweep(
    op_names: list[str] | None = None, suite: str = "llm", fuzz: int = 3, quick: bool = False, log=None
) -> tuple[list[LaunchSpec], list[DriveError]]:
    """Drive every case (see `sweep_cases`) with launches recorded; distinct launch specs and the
    cases whose launcher failed on the way. One set of inputs per (shape, dtype) serves every backend
    (launches depend on shapes, not values, and outputs are never written)."""
    errors: list[DriveError] = []
    with record_launches() as recorder, _cheap_big_random(), _CheapBigMatmuls():
        for spec, backends, shape, dtype, kind in sweep_cases(op_names, suite, fuzz, quick):
            case = f"{spec.name} {str(dtype).replace('torch.', '')} {json.dumps(shape)} [{kind}]"
            start = time.perf_counter()
            try:
                inputs = spec.make_inputs(shape, dtype, torch.device("cpu"), torch.Generator().manual_seed(0))
            except Exception as exc:
                errors.append(DriveError(case, f"make_inputs: {type(exc).__name__}: {exc}"[:500]))
                continue
            for backend, fn in backends.items():
                _drive_one(recorder, f"{spec.name}/{backend} {case.split(' ', 1)[1]}", fn, inputs, errors)
            del inputs
            if log is not None:
                log(f"  drove {case} ({time.perf_counter() - start:.1f}s, {len(recorder.specs)} specs)")
    return list(recorder.specs.values()), errors


def _drive_one(recorder: LaunchRecorder, source: str, fn, inputs: dict, errors: list[DriveError]) -> None:
    recorder.current_source = source
    before = recorder.launches
    try:
        fn(**inputs)
    except Exception as exc:  # code after a recorded launch reads garbage outputs: report, go on
        if recorder.launches == before:  # failed before its first launch
            errors.append(DriveError(source, f"{type(exc).__name__}: {exc}"[:500]))


def compile_all(specs: list[LaunchSpec], per_kernel: int | None = None, log=None) -> list[CompileResult]:
    """Compile each spec for sm_90 (at most `per_kernel` specs of each kernel when given)."""
    results, seen = [], {}
    for spec in specs:
        seen[spec.kernel] = seen.get(spec.kernel, 0) + 1
        if per_kernel is not None and seen[spec.kernel] > per_kernel:
            continue
        start = time.perf_counter()
        results.append(compile_spec(spec))
        if log is not None:
            log(_row(results[-1]) + f"  ({time.perf_counter() - start:.1f}s)")
    return results


def _row(result: CompileResult) -> str:
    status = "ok" if result.error is None else "FAIL"
    spills = "?" if result.spill_bytes < 0 else str(result.spill_bytes)
    kernel = result.spec.kernel.rsplit(".", 1)[-1]
    return (
        f"{status:4} spill={spills:>5} regs={result.registers:>4} smem={result.shared_bytes:>6}  "
        f"{kernel}  {result.spec.constexpr_summary()}"
    )


DESCRIPTION = "Compile every Triton launch Kiln's ops make for sm_90 (H100), without a GPU."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", help="only this op (repeatable); default: all")
    parser.add_argument("--suite", default="llm", help="bench shape suite (default: llm)")
    parser.add_argument("--fuzz", type=int, default=3, help="fuzz shapes per op (default: 3)")
    parser.add_argument("--quick", action="store_true", help="first/last suite shape, bf16 (+fp8) only")
    parser.add_argument("--per-kernel", type=int, help="compile at most this many specs per kernel")
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--verbose", action="store_true", help="print each driven case and its time")


def run(args: argparse.Namespace) -> int:
    import triton

    start = time.perf_counter()
    log = (lambda line: print(line, flush=True)) if args.verbose else None
    specs, errors = record_sweep(args.op, args.suite, args.fuzz, args.quick, log)
    print(f"triton {triton.__version__}: {len(specs)} distinct launches recorded in "
          f"{time.perf_counter() - start:.0f}s", flush=True)  # fmt: skip
    results = compile_all(specs, args.per_kernel, log=lambda line: print(line, flush=True))
    failed = [r for r in results if r.error is not None]
    spilled = [r for r in results if r.spill_bytes > 0]
    hot_spilled = [r for r in spilled if r.hot_spill]
    for error in errors:
        print(f"DRIVE ERROR {error.source}: {error.error}")
    for result in failed:
        print(f"FAIL {result.spec.kernel} {result.spec.constexpr_summary()}\n  {result.spec.signature}\n"
              f"  from {result.spec.sources[:3]}\n  {result.error[-1500:]}")  # fmt: skip
    for result in hot_spilled:
        print(f"SPILL {result.spill_bytes} bytes: {result.spec.kernel} {result.spec.constexpr_summary()}\n"
              f"  {result.spec.signature}\n  from {result.spec.sources[:3]}")  # fmt: skip
    print(f"{len(results)} compiled, {len(failed)} failed, {len(spilled)} spill registers "
          f"({len(hot_spilled)} hot: 16/8-bit, real shapes), "
          f"{len(errors)} drive errors ({time.perf_counter() - start:.0f}s)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "results": [r.as_dict() for r in results],
                       "drive_errors": [e.__dict__ for e in errors]}, f, indent=1)  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.tune.aot", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
