"""The structured-outputs flags of `kiln generate`: --json-schema, --json-object, --regex, --choice and
--grammar (SamplingParams.structured_outputs; kiln.engine.structured_outputs)."""

from __future__ import annotations

import argparse
import json
import os

from kiln.engine.sampling_params import StructuredOutputsParams


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    """At most one of --json-schema, --json-object, --regex, --choice (repeated) and --grammar."""
    group = parser.add_argument_group("structured outputs (at most one)").add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", default=None, metavar="SCHEMA",
        help="the output is JSON this schema accepts: a file, or the schema's JSON text",
    )  # fmt: skip
    group.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    group.add_argument("--regex", default=None, help="the output matches this regular expression whole")
    group.add_argument(
        "--choice", action="append", default=None, metavar="TEXT",
        help="the output is one of these texts (repeat the flag for each)",
    )  # fmt: skip
    group.add_argument(
        "--grammar", default=None, metavar="EBNF",
        help="the output is a sentence of this EBNF grammar (start rule `root`): a file, or its text",
    )  # fmt: skip


def structured_from_args(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The flags as StructuredOutputsParams (None when none is given); ValueError for a schema that is
    neither a readable file nor JSON text."""
    if args.json_schema is not None:
        text = _file_or_text(args.json_schema)
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--json-schema: neither a file nor JSON text ({exc})") from None
        return StructuredOutputsParams(json=schema)
    if args.json_object:
        return StructuredOutputsParams(json_object=True)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice is not None:
        return StructuredOutputsParams(choice=list(args.choice))
    if args.grammar is not None:
        return StructuredOutputsParams(grammar=_file_or_text(args.grammar))
    return None


def _file_or_text(value: str) -> str:
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value
