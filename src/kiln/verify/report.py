"""Printing and saving `kiln verify` results."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from kiln.verify.runner import Row


def status(row: Row) -> str:
    if row.skipped:
        return f"SKIP ({row.skipped})"
    return "PASS" if row.passed else "FAIL"


def format_table(rows: list[Row]) -> str:
    header = ("op", "backend", "dtype", "cases", "worst rel err", "tolerance", "result")
    lines = [header] + [
        (
            r.op,
            r.backend,
            r.dtype,
            str(r.cases),
            f"{r.worst_error:.2e}" if r.cases else "-",
            f"{r.tolerance:.1e}" if r.tolerance else "-",
            status(r),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        for failure in r.failures[:3]:
            out.append(
                f"  FAILED {r.op}/{r.backend}/{r.dtype} shape={failure['shape']} seed={failure['seed']}: "
                f"error={failure['error']:.3e} {failure['failure']}".rstrip()
            )
    return "\n".join(out)


def write_json(rows: list[Row], path: str | Path, device: str) -> None:
    payload = {
        "kind": "kiln-verify",
        "version": 1,
        "device": device,
        "device_name": torch.cuda.get_device_name()
        if device.startswith("cuda")
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "rows": [dict(asdict(r), passed=r.passed) for r in rows],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str))
