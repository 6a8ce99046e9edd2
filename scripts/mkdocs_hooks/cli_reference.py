"""MkDocs hook: fill docs/api/cli.md's `<!-- kiln-cli-help -->` marker with the `--help` text of
`kiln` and every subcommand, taken from the real argparse parsers (`kiln.cli.build_parser`)."""

from __future__ import annotations

import argparse

MARKER = "<!-- kiln-cli-help -->"


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, [*path, name])


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from kiln.cli import build_parser

    sections = []
    for path, parser in _walk(build_parser(), ["kiln"]):
        parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
        sections.append(f"## `{' '.join(path)}`\n\n```text\n{parser.format_help()}```\n")
    return markdown.replace(MARKER, "\n".join(sections))
