"""`kiln verify [--op NAME] [--backend NAME] [--dtype NAME] [--json PATH]`, and
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
    from kiln.verify.quant_model_cli import add_arguments

    add_arguments(p)  # --quant-model mode
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.quant_model is not None:
        from kiln.verify.quant_model_cli import run_cli

        return run_cli(args)
    from kiln.verify.report import format_table, status, write_json
    from kiln.verify.runner import verify

    def progress(row):
        print(f"  {row.op:<28} {row.backend:<11} {row.dtype:<9} {status(row)}", file=sys.stderr, flush=True)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = verify(args.op, args.backend, args.dtype, device, args.seed, progress=progress)
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json, device)
    ran = [r for r in rows if not r.skipped]
    failed = [r for r in ran if not r.passed]
    print(f"\n{len(ran) - len(failed)} passed, {len(failed)} failed, {len(rows) - len(ran)} skipped")
    return 1 if failed or not ran else 0
