"""The `kiln` command. Each subcommand lives with the code it drives and adds its own parser."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# module path of each subcommand; each module has add_parser(subparsers) and sets `func`.
SUBCOMMANDS = [
    "kiln.verify.cli",
    "kiln.bench.cli",
    "kiln.tune.cli",
    "kiln.profile.cli",
    "kiln.entrypoints.generate",
    "kiln.entrypoints.sparsify",
    "kiln.entrypoints.quantize",
    "kiln.server.cli",
]


def _prepare_environment(argv: list[str]) -> None:
    """Without a GPU, `kiln verify/tune` check the Triton kernels through Triton's interpreter;
    that must be decided before any kernel module is imported. `kiln tune aot` compiles the kernels
    instead, which the interpreter cannot."""
    if argv[:2] == ["tune", "aot"]:
        return
    if argv and argv[0] in ("verify", "tune") and "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="Kiln: kernels, tooling and an inference engine"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # that subcommand is not part of this build
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tune"]:
        from kiln.tune.cli import expand_op_shorthand

        argv = ["tune", *expand_op_shorthand(argv[1:])]
    _prepare_environment(argv)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
