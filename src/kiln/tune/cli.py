"""`kiln tune OP [--dtype NAME ...] [--shapes JSON|FILE|SUITE] [--budget N] [--strategy exhaustive|random]
[--backend NAME] [--export [PATH]]`: tune an op's declared configs per shape and store the winners."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("tune", help="autotune an op's configs (each candidate verified before timing)")
    p.add_argument("op", help="op name, e.g. rms_norm")
    p.add_argument(
        "--dtype", action="extend", nargs="+", help="dtype name(s); default bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument("--shapes", default=None, help="JSON shape dict/list, a .json file, or a suite name")
    p.add_argument("--suite", default="llm", help="shape suite when --shapes is not given")
    p.add_argument(
        "--backend", default=None, help="implementation to tune (default: triton, else the tunable one)"
    )
    p.add_argument("--strategy", choices=("exhaustive", "random"), default="exhaustive")
    p.add_argument("--budget", type=int, default=None, help="most candidates per shape")
    p.add_argument("--seed", type=int, default=0, help="seed for inputs and random sampling")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--reps", type=int, default=None, help="timing samples per candidate")
    p.add_argument("--no-save", action="store_true", help="report only; do not write the tuning cache")
    p.add_argument(
        "--export",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also write the winners in the shipped format (default src/kiln/tune/configs/<device>.json)",
    )
    p.set_defaults(func=run)


def _tunable_backend(spec, requested: str | None) -> str:
    if requested:
        return requested
    tunable = [name for name, impl in spec.implementations.items() if impl.configs is not None]
    if not tunable:
        raise ValueError(f"kiln tune: {spec.name} has no implementation that declares configs")
    return "triton" if "triton" in tunable else tunable[0]


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from kiln.bench.suites import default_dtypes, dtype_from_name, parse_shapes
    from kiln.ops.registry import get_op
    from kiln.tune.cache import export
    from kiln.tune.runner import tune_shape
    from kiln.verify.runner import backend_dtypes

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        spec = get_op(args.op)
        backend = _tunable_backend(spec, args.backend)
        shapes = parse_shapes(args.shapes, spec, args.suite)
        dtypes = [dtype_from_name(d) for d in args.dtype] if args.dtype else default_dtypes(spec, device)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not shapes:
        print(f"kiln tune: {spec.name} has no shapes in suite {args.suite!r}; pass --shapes", file=sys.stderr)
        return 2
    runnable, gpu_only = backend_dtypes(spec, backend, device)
    timing_kwargs = {"reps": args.reps} if args.reps else {}
    keys, failures = [], 0
    for dtype in dtypes:
        if dtype in gpu_only or dtype not in runnable:
            print(f"skip {spec.name} {dtype}: not checkable on {device} for {backend}", file=sys.stderr)
            continue
        for shape in shapes:
            n = (
                len(spec.implementation(backend).configs(shape, dtype))
                if spec.implementation(backend).configs
                else 0
            )
            total = min(n, args.budget) if args.budget else n
            with tqdm(total=total, desc=f"{spec.name} {str(dtype)[6:]} {shape}", file=sys.stderr) as bar:
                try:
                    result = tune_shape(
                        spec,
                        backend,
                        shape,
                        dtype,
                        device,
                        strategy=args.strategy,
                        budget=args.budget,
                        seed=args.seed,
                        save=not args.no_save,
                        timing_kwargs=timing_kwargs,
                        progress=bar,
                    )
                except ValueError as exc:
                    print(exc, file=sys.stderr)
                    return 2
            print(format_result(result))
            if result.best is None:
                failures += 1
            elif result.cache_key:
                keys.append(result.cache_key)
    if args.export is not None and keys:
        path = export(keys, args.export or None, device)
        print(f"exported {len(keys)} config(s) to {path}")
    return 1 if failures else 0


def format_result(result) -> str:
    ok = [t for t in result.trials if t.status == "ok"]
    lines = [
        f"{result.op} [{result.backend}] {result.dtype} {result.shape}: {len(result.trials)} candidates, "
        f"{len(ok)} correct"
    ]
    for trial in sorted(result.trials, key=lambda t: (t.status != "ok", t.median_ms or 0.0)):
        mark = "*" if trial is result.best else " "
        timing = f"{trial.median_ms * 1e3:10.1f} us" if trial.median_ms is not None else " " * 13
        lines.append(f"  {mark} {trial.status:<8} {timing}  {trial.config}  {trial.note}".rstrip())
    if result.best is None:
        lines.append("  no correct config: nothing stored")
    elif result.cache_key:
        lines.append(f"  stored as {result.cache_key}")
    return "\n".join(lines)
