"""`kiln verify [--op NAME] [--backend NAME] [--dtype NAME] [--shard I/N] [--json PATH]`,
`kiln verify --grad [--op NAME] [--backend triton|cpu] [--dtype NAME] [--json PATH]` (every
backward against float64 autograd: kiln.verify.grad), and
`kiln verify --quant-model [PATH] --format FMT [--json PATH]` (kiln.verify.quant_model_cli)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("verify", help="check every op against its float64 reference")
    p.add_argument("--op", action="append", help="op name (repeatable); default: all registered ops")
    p.add_argument(
        "--backend", action="append", help="implementation name (repeatable); default: all available"
    )
    p.add_argument("--dtype", action="append", help="dtype name such as float16 (repeatable)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--seed", type=int, default=None, help="seed for shapes and inputs (default: fresh)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="only the I-th of every N ops that have the backends asked for (N processes side by side)",
    )
    p.add_argument(
        "--grad",
        action="store_true",
        help="check the backward of every differentiable op (gradients of each input) instead",
    )
    from kiln.verify.quant_model_cli import add_arguments

    add_arguments(p)  # --quant-model mode
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.quant_model is None and (getattr(args, "against", None) or args.format):
        print("kiln verify: --format / --against need --quant-model [PATH]", file=sys.stderr)
        return 2
    if args.quant_model is not None:
        from kiln.verify.quant_model_cli import run_cli

        return run_cli(args)
    if args.grad:
        return run_grad(args)
    import torch

    from kiln import fallbacks
    from kiln.verify.report import format_fallbacks, format_table, replaced_by_fallback, status, write_json
    from kiln.verify.runner import verify

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    done = []

    def progress(row):
        print(f"  {row.op:<28} {row.backend:<11} {row.dtype:<9} {status(row)}", file=sys.stderr, flush=True)
        done.append(row)
        if args.json:  # after every row: a run stopped by a time limit keeps what finished
            write_json(done, args.json, device, complete=False)

    try:
        shard = _shard(args.shard)
        rows = verify(args.op, args.backend, args.dtype, device, args.seed, progress=progress, shard=shard)
    except ValueError as exc:  # an unknown op, backend, dtype or shard: named before any case runs
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # SIGINT, e.g. `timeout -s INT`: report what finished, then stop
        print(f"\nkiln verify: interrupted after {len(done)} rows", file=sys.stderr)
        rows, interrupted = done, True
    else:
        interrupted = False
    print(format_table(rows))
    notes = format_fallbacks(rows)
    if notes:
        print(notes)
    if args.json:
        write_json(rows, args.json, device, complete=not interrupted)
    ran = [r for r in rows if not r.skipped]
    failed = [r for r in ran if not r.passed]
    # a row whose kernel a recorded fallback replaced checked the replacement: not a pass of its own
    taken = fallbacks.taken()
    fell_back = [r for r in ran if r.passed and replaced_by_fallback(r, taken)]
    passed = len(ran) - len(failed) - len(fell_back)
    counts = f"{passed} passed, {len(failed)} failed, {len(rows) - len(ran)} skipped"
    print(f"\n{counts}" + (f", {len(fell_back)} fell back (not verified)" if fell_back else ""))
    if interrupted:
        return 130
    return 1 if failed or fell_back or not ran else 0


def _shard(text: str | None) -> tuple[int, int] | None:
    """"I/N" -> (I, N); ValueError naming the flag when malformed."""
    if text is None:
        return None
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise ValueError(f"kiln verify: --shard {text!r}: expected I/N with 1 <= I <= N, e.g. 2/4")
    return int(index), int(count)


def run_grad(args: argparse.Namespace) -> int:
    """`kiln verify --grad`: exit 1 when any gradient fails (or nothing ran), 2 on bad arguments."""
    import json
    from pathlib import Path

    import torch

    from kiln.verify.grad import format_grad_table, grad_json, verify_grad
    from kiln.verify.report import status

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def progress(row):
        print(
            f"  {row.op:<28} {row.input:<9} {row.backend:<7} {row.dtype:<9} {status(row)}",
            file=sys.stderr,
            flush=True,
        )

    try:
        rows = verify_grad(args.op, args.backend, args.dtype, device, args.seed, progress=progress)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(format_grad_table(rows))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(grad_json(rows, device), indent=2, default=str))
    ran = [r for r in rows if not r.skipped]
    failed = [r for r in ran if not r.passed]
    print(f"\n{len(ran) - len(failed)} passed, {len(failed)} failed, {len(rows) - len(ran)} skipped")
    return 1 if failed or not ran else 0
