"""`kiln tune`: autotune an op, or compile every Triton launch for sm_90.

kiln tune OP [--dtype NAME ...] [--shapes JSON|FILE|SUITE] [--budget N] [--strategy exhaustive|random]
             [--backend NAME] [--export [PATH]]
    tune an op's declared configs per shape and store the winners (short for `kiln tune op OP ...`)
kiln tune aot [--op NAME ...] [--quick] [--per-kernel N] [--json PATH]
    compile every Triton launch Kiln's ops make for sm_90 (H100), without a GPU (kiln.tune.aot)
"""

from __future__ import annotations

import argparse
import sys

SUBCOMMANDS = ("op", "aot")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "tune",
        help="autotune an op's configs (each candidate verified before timing), or the sm_90 AOT sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="tune_command", required=True, metavar="{OP,aot}")
    o = sub.add_parser("op", prog="kiln tune", help="tune one op (`kiln tune OP ...`)")
    o.add_argument("op", help="op name, e.g. rms_norm")
    o.add_argument(
        "--dtype", action="extend", nargs="+", help="dtype name(s); default bf16 on CUDA, fp32 on CPU"
    )
    o.add_argument("--shapes", default=None, help="JSON shape dict/list, a .json file, or a suite name")
    o.add_argument("--suite", default="llm", help="shape suite when --shapes is not given")
    o.add_argument(
        "--backend", default=None, help="implementation to tune (default: triton, else the tunable one)"
    )
    o.add_argument("--strategy", choices=("exhaustive", "random"), default="exhaustive")
    o.add_argument("--budget", type=int, default=None, help="most candidates per shape")
    o.add_argument("--seed", type=int, default=0, help="seed for inputs and random sampling")
    o.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    o.add_argument("--reps", type=int, default=None, help="timing samples per candidate")
    o.add_argument("--no-save", action="store_true", help="report only; do not write the tuning cache")
    o.add_argument(
        "--export",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also write the winners in the shipped format (default kiln/ops/shipped_configs/<device>.json)",
    )
    o.set_defaults(func=run)
    from kiln.tune.aot import sweep

    a = sub.add_parser("aot", prog="kiln tune aot", help=sweep.DESCRIPTION, description=sweep.DESCRIPTION)
    sweep.add_arguments(a)
    a.set_defaults(func=sweep.run)


def expand_op_shorthand(argv: list[str]) -> list[str]:
    """`kiln tune OP ...` -> `kiln tune op OP ...`: an op name is not a subcommand argparse could list,
    and argparse has no default subcommand. `argv` starts after "tune"."""
    if argv and (argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help")):
        return argv
    return ["op", *argv]


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
    from kiln.ops import get_op
    from kiln.ops.tuned_configs import export
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
