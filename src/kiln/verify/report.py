"""Printing and saving `kiln verify` results."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from kiln import fallbacks
from kiln.environment import environment
from kiln.text_table import aligned_table
from kiln.verify.runner import Row


def status(row) -> str:
    """PASS / FAIL / SKIP (reason) of a verify row (Row, or verify.grad's GradRow)."""
    if row.skipped:
        return f"SKIP ({row.skipped})"
    return "PASS" if row.passed else "FAIL"


def format_table(rows: list[Row]) -> str:
    header = ("op", "backend", "dtype", "cases", "worst rel err", "tolerance", "result")
    rows_text = [
        (
            r.op,
            r.backend,
            r.dtype,
            str(r.cases),
            f"{r.worst_error:.2e}" if r.cases else "-",
            "-" if r.skipped else f"{r.tolerance:.1e}",
            status(r),
        )
        for r in rows
    ]
    out = aligned_table(header, rows_text).split("\n")
    for r in rows:
        for failure in r.failures[:3]:
            out.append(
                f"  FAILED {r.op}/{r.backend}/{r.dtype} shape={failure['shape']} seed={failure['seed']}: "
                f"error={failure['error']:.3e} {failure['failure']}".rstrip()
            )
    return "\n".join(out)


def format_fallbacks(rows: list[Row]) -> str:
    """One line per recorded fallback (kiln.fallbacks) and the rows it replaced; "" when none."""
    lines = []
    for entry in fallbacks.taken():
        hit = [f"{r.op}/{r.backend}" for r in rows if fallbacks.replacement(r.op, r.backend, [entry])]
        replaced = sorted(set(hit))
        lines.append(
            f"FALLBACK {entry['kind']} taken ({entry['detail']})"
            + (f": {', '.join(replaced)} checked the replacement, not the kernel" if replaced else "")
        )
    return "\n".join(lines)


def replaced_by_fallback(row: Row, entries: list[dict]) -> tuple[dict, str] | None:
    """(the fallback entry, the implementation that ran) when a recorded fallback replaced the row's
    implementation (kiln.fallbacks.replacement): the row checked the replacement, not its own kernel."""
    return None if row.skipped else fallbacks.replacement(row.op, row.backend, entries)


def row_json(row: Row, entries: list[dict]) -> dict:
    """A row as JSON; a row whose implementation a fallback replaced gets `fallback`, a backend
    "<asked>-><what ran>" (kiln.fallbacks.replacement) and `passed` false: it checked the replacement,
    not its own kernel."""
    out = dict(asdict(row), passed=row.passed, fallback=None)
    hit = replaced_by_fallback(row, entries)
    if hit is not None:
        entry, ran = hit
        out["fallback"] = f"{entry['kind']}: {entry['detail']}"
        out["backend"] = f"{row.backend}->{ran}"
        out["passed"] = False
    return out


def write_json(rows: list[Row], path: str | Path, device: str, complete: bool = True) -> None:
    """The results so far: `complete` is False while `kiln verify` is still running (it rewrites the file
    after each row, so a run that is stopped keeps what finished) and when it was interrupted."""
    env = environment()
    payload = {
        "kind": "kiln-verify",
        "version": 1,
        "complete": complete,
        "device": device,
        "device_name": env["gpu_name"] if device.startswith("cuda") else env["cpu_model"] or "cpu",
        "torch": torch.__version__,
        "environment": env,
        "rows": [row_json(r, env["fallbacks"]) for r in rows],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=2, default=str))
    partial.replace(path)  # a reader (or a kill) never sees half a file
