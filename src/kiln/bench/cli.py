"""`kiln bench`: op benchmarks against measured roofline ceilings, plus its subcommands.

kiln bench [--suite llm] [--op NAME ...] [--dtype NAME ...] [--shapes JSON|FILE|SUITE] [--backend NAME]
           [--out DIR] [--suffix TEXT] [--no-baselines] [--compare-backends A,B] [--device cuda|cpu]
           [--reps N]
kiln bench --backward [--op NAME ...] [--no-compile] ...   forward+backward of the ops with a backward
                        vs torch autograd (eager, torch.compile), with peak memory (kiln.bench.backward)
kiln bench compare OLD.json NEW.json [--threshold 0.05] [--allow-missing] [--force] [--strict]
kiln bench engine ...   the engine's throughput and latency vs HF transformers; --decode-loop: one
                        sequence through the model alone (kiln.bench.engine)
kiln bench serve ...    load test of `kiln serve` over loopback HTTP (kiln.bench.serve)
kiln bench tp ...       decode speed of TP 1 vs TP N (kiln.bench.tp)
kiln bench parallel ... tokens/s and communication share per step of a TP / PP / EP layout
                        (kiln.bench.parallel)
"""

from __future__ import annotations

import argparse
import sys

from kiln.bench import engine, parallel, serve, tp

# subcommand -> (module with add_arguments(parser) and run(args), help); heavy imports stay inside run
BENCHMARKS = {
    "engine": (engine, "the engine's throughput and latency vs HF transformers (--decode-loop: the model)"),
    "serve": (serve, "load test of `kiln serve` over loopback HTTP"),
    "tp": (tp, "decode speed of TP 1 vs TP N, all-reduce time per decode step"),
    "parallel": (parallel, "tokens/s and communication share per step of a TP / PP / EP layout"),
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark ops against baselines and the measured roofline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--suite", default="llm", help="shape suite of each op (OpSpec.bench_shapes key)")
    p.add_argument("--op", action="extend", nargs="+", help="op name(s); default: every op in the suite")
    p.add_argument(
        "--dtype", action="extend", nargs="+", help="dtype name(s); default bfloat16 on CUDA, float32 on CPU"
    )
    p.add_argument("--shapes", default=None, help="JSON shape dict/list, a .json file, or a suite name")
    p.add_argument("--backend", default=None, help="implementation to time (default: what dispatch picks)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--out", default="bench/results", help="directory for the JSON, Markdown and PNG")
    p.add_argument("--suffix", default=None, help="appended to the result file name")
    p.add_argument("--no-baselines", action="store_true", help="time only Kiln's implementation")
    p.add_argument(
        "--compare-backends",
        default="",
        help="comma-separated other Kiln implementations to time in the same run, e.g. triton,xla "
        "(recorded as baselines kiln_<name>)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the roofline PNG")
    p.add_argument("--reps", type=int, default=None, help="timing samples per case (default 50 CUDA, 5 CPU)")
    p.add_argument("--refresh-ceilings", action="store_true", help="re-measure the device ceilings")
    p.add_argument(
        "--backward",
        action="store_true",
        help="time forward+backward (and peak memory) of the ops with a backward against torch autograd",
    )
    p.add_argument(
        "--no-compile", action="store_true", help="with --backward: skip the torch.compile baseline"
    )
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="bench_command", metavar="{compare,engine,parallel,serve,tp}")
    c = sub.add_parser("compare", help="flag regressions between two result files (exit 1 if any)")
    c.add_argument("old", help="baseline result JSON")
    c.add_argument("new", help="new result JSON")
    c.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="smallest relative slow-down that counts (the runs' spread can raise it)",
    )
    c.add_argument(
        "--allow-missing", action="store_true", help="do not fail on cases OLD has and NEW lacks"
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="compare runs from different devices or CPUs (their timings are not comparable)",
    )
    c.add_argument(
        "--strict",
        action="store_true",
        help="also fail on 'noisy' cases: slower past the threshold but within the runs' spread",
    )
    c.set_defaults(func=run_compare)
    for name, (module, help_text) in BENCHMARKS.items():
        b = sub.add_parser(
            name,
            prog=f"kiln bench {name}",
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(b)
        own = tuple(vars(b.parse_args([])))  # the benchmark's own option names (none is required)
        b.set_defaults(func=_benchmark_runner(module.run, own))


def run(args: argparse.Namespace) -> int:
    import torch

    from kiln.bench import plot, report, results
    from kiln.bench.ceilings import measure_ceilings
    from kiln.bench.runner import bench, print_progress
    from kiln.bench.suites import resolve_cases

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.backward:
        from kiln.bench.backward import run_backward

        return run_backward(args, device)
    try:
        cases = resolve_cases(args.op, args.suite, args.shapes, args.dtype, device)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not cases:
        print(
            f"kiln bench: nothing to run (no op with shapes in suite {args.suite!r} for the dtypes asked)",
            file=sys.stderr,
        )
        return 2
    print(f"kiln bench: measuring {device} ceilings (cached after the first run)...", file=sys.stderr)
    ceilings = measure_ceilings(device, refresh=args.refresh_ceilings)
    print(
        f"  {ceilings.device_name}: {ceilings.bandwidth_gbs:.1f} GB/s, "
        + ", ".join(f"{k} {v:.2f} TFLOP/s" for k, v in ceilings.matmul_tflops.items()),
        file=sys.stderr,
    )
    timing_kwargs = {"reps": args.reps} if args.reps else {}
    compare = tuple(name for name in args.compare_backends.split(",") if name)
    records = bench(
        cases,
        device,
        ceilings,
        args.backend,
        not args.no_baselines,
        timing_kwargs,
        progress=print_progress,
        compare_backends=compare,
    )
    from dataclasses import asdict

    metadata = results.collect_metadata(device, ceilings.device_name, args.shapes or args.suite, args.backend)
    payload = results.make_payload(metadata, asdict(ceilings), records)
    path = results.write(payload, args.out, args.suffix)
    md_path = report.write_markdown(payload, path.with_suffix(".md"))
    print(report.format_markdown(payload))
    print(f"wrote {path}\nwrote {md_path}")
    if not args.no_plot:
        print(f"wrote {plot.plot_roofline(payload, path.with_suffix('.png'))}")
    errors = [r for r in records if r["error"]]
    return 1 if len(errors) == len(records) else 0


def run_compare(args: argparse.Namespace) -> int:
    from kiln.bench import results
    from kiln.bench.compare import compare_cases, exit_code, format_comparison

    try:
        old, new = results.load(args.old), results.load(args.new)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    old_host, new_host = results.host_of(old["metadata"]), results.host_of(new["metadata"])
    differ = [k for k in old_host if old_host[k] != new_host.get(k)]
    if differ:
        what = "; ".join(f"{k}: {old_host[k]} vs {new_host.get(k)}" for k in differ)
        if not args.force:
            print(f"kiln bench compare: the runs are from different hosts ({what}): their timings are not "
                  "comparable (--force to compare anyway)", file=sys.stderr)  # fmt: skip
            return 2
        print(f"note: comparing different hosts ({what})", file=sys.stderr)
    rows = compare_cases(old, new, args.threshold)
    print(format_comparison(rows))
    return exit_code(rows, args.allow_missing, args.strict)


def _benchmark_runner(run_benchmark, options: tuple[str, ...]):
    """`run_benchmark` called with only its own options: the namespace also holds the op benchmark's
    (`kiln bench --suite ...`), which must not reach the result JSON's "config"."""

    def run_with_own_options(args: argparse.Namespace) -> int:
        return int(run_benchmark(argparse.Namespace(**{k: getattr(args, k) for k in options})) or 0)

    return run_with_own_options
