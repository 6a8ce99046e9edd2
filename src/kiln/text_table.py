"""Plain-text tables for the command-line reports (verify, bench compare, profile)."""

from __future__ import annotations

from collections.abc import Sequence


def aligned_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """`header` and `rows` (strings, one per column) as left-aligned columns two spaces apart, with a
    dashed line under the header; trailing spaces stripped."""
    lines = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
