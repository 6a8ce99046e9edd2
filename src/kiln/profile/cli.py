"""`kiln profile --op NAME [--shape JSON] [--dtype NAME] [--backend NAME] [--steps N] [--trace PATH]`
or `kiln profile --engine [--model PATH] [--batch N] [--device D] [--eager]`: per-kernel table,
roofline per op, gap report; the engine run adds decode tok/s and the share of kernel time in Kiln's
kernels."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> None:
    from kiln.engine.cpu_args import add_cpu_arguments

    p = subparsers.add_parser("profile", help="profile an op or an engine decode step (torch.profiler)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--op", help="registered op to profile")
    what.add_argument("--engine", action="store_true", help="one decode step of the engine")
    p.add_argument("--shape", default=None, help="JSON shape dict (default: the op's first llm bench shape)")
    p.add_argument("--dtype", default=None, help="dtype name (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--backend", default=None, help="implementation (default: what dispatch picks)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument(
        "--steps", type=int, default=None, help="profiled calls (default 5; engine: decode steps, 1)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="engine model: GGUF, HF dir or random:<preset> (default: embedded SmolLM2)",
    )
    p.add_argument("--batch", type=int, default=4, help="engine: concurrent requests")
    add_cpu_arguments(p)  # engine on the CPU: --cpu-format, --lm-head-format, --compile-cpu-decode
    p.add_argument("--timed-steps", type=int, default=5, help="engine: unprofiled decode steps timed")
    p.add_argument(
        "--eager",
        action="store_true",
        help="engine: no CUDA graphs, so the decode step's ops are put on the roofline (graph replays "
        "declare no op calls)",
    )
    p.add_argument("--trace", default=None, help="write a Chrome trace (chrome://tracing, Perfetto) here")
    p.add_argument("--top", type=int, default=30, help="kernels to list")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kiln.profile.engine_step import format_phases
    from kiln.profile.gap import format_gaps, format_kernels, format_ops

    try:
        if args.engine:
            from kiln.profile.engine_step import profile_engine_step

            engine_profile = profile_engine_step(
                args.model,
                args.batch,
                args.steps or 1,
                args.trace,
                device=args.device,
                timed_steps=args.timed_steps,
                compile_cpu_decode=args.compile_cpu_decode,
                cpu_format=args.cpu_format,
                lm_head_format=args.lm_head_format,
                eager=args.eager,
            )
            report = engine_profile.report
        else:
            from kiln.bench.suites import default_dtypes, dtype_from_name
            from kiln.ops import get_op
            from kiln.profile.profiler import profile_op

            spec = get_op(args.op)
            device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            if args.shape:
                shape = json.loads(args.shape)
            elif spec.bench_shapes.get("llm"):
                shape = spec.bench_shapes["llm"][0]
            else:
                raise ValueError(f"kiln profile: {spec.name} has no llm bench shapes; pass --shape JSON")
            dtype = dtype_from_name(args.dtype) if args.dtype else default_dtypes(spec, device)[0]
            print(f"profiling {spec.name} {shape} {dtype} on {device}", file=sys.stderr)
            report = profile_op(spec.name, shape, dtype, device, args.backend, args.steps or 5, args.trace)
    except ModuleNotFoundError as exc:
        if "kiln.engine" in str(exc):
            print(exc, file=sys.stderr)
            return 2
        raise
    except (ValueError, json.JSONDecodeError) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(format_kernels(report, args.top))
    if report.ops:
        print("\nops on the roofline:\n" + format_ops(report))
    print("\nutilization gaps (time x (1 - roofline fraction)):\n" + format_gaps(report))
    if args.engine:
        p = engine_profile
        print(
            f"\ndecode step at batch {p.batch}: {p.decode_step_ms:.2f} ms, {p.decode_tok_s:.1f} tok/s "
            f"(unprofiled{', compiled' if p.compiled_decode else ''})\n"
            f"kernel time in Kiln kernels (Triton): {100 * p.kiln_share:.1f}%; "
            f"mapped to Kiln ops: {100 * p.op_share:.1f}%"
        )
        if p.phase_ms:
            print("\n" + format_phases(p.phase_ms))
    if report.trace_path:
        print(f"\nwrote Chrome trace {report.trace_path}")
    return 0
