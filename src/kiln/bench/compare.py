"""`kiln bench compare OLD NEW`: per case, is NEW slower than OLD by more than noise?

A case (op, shape, dtype, backend) regressed when
    new_median / old_median - 1 > max(threshold, combined spread)
where combined spread = sqrt(old_rel_spread^2 + new_rel_spread^2) and rel_spread = (p80 - p20) / median
of that run: a difference inside both runs' own noise is not a regression, whatever its size. The
same rule the other way flags improvements. A slow-down past the threshold that the spread swallows
is "noisy", not "same": inconclusive, listed so it is seen, and a failure with `strict` (rerun on a
quieter machine, or with more --reps, to decide). A case that ran in OLD and errors in NEW is
"broken" (also a failure), and so is one that ran its own kernel in OLD and fell back to another in
NEW ("fell-back": the case is matched on the backend asked for). A case OLD has and NEW lacks
("missing-in-new": a renamed op, another suite) fails unless allowed; one only NEW has is listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.bench.results import case_key
from kiln.text_table import aligned_table

FAILING = ("regressed", "broken", "fell-back")  # statuses that make `kiln bench compare` exit 1


@dataclass
class Comparison:
    key: tuple[str, str, str, str]
    old_ms: float | None
    new_ms: float | None
    change: float | None  # new / old - 1 (positive = slower)
    allowed: float | None  # the change that counts as noise
    # regressed | broken | fell-back | improved | fixed | noisy | same | missing-in-old | missing-in-new
    # | error
    status: str


def compare_cases(old: dict, new: dict, threshold: float = 0.05) -> list[Comparison]:
    """Compare two result payloads case by case (in NEW's order, then cases only OLD has)."""
    old_cases = {case_key(c): c for c in old["cases"]}
    new_cases = {case_key(c): c for c in new["cases"]}
    out = []
    for key, n in new_cases.items():
        o = old_cases.get(key)
        if o is None:
            out.append(Comparison(key, None, n["median_ms"], None, None, "missing-in-old"))
        elif n.get("fallback") and not o.get("fallback"):
            out.append(Comparison(key, o["median_ms"], n["median_ms"], None, None, "fell-back"))
        elif o["error"] or n["error"]:
            # ran before and fails now: broken (fails the comparison); the other way round: fixed
            status = "error" if o["error"] and n["error"] else "broken" if n["error"] else "fixed"
            out.append(Comparison(key, o["median_ms"], n["median_ms"], None, None, status))
        else:
            out.append(_compare_one(key, o, n, threshold))
    for key, o in old_cases.items():
        if key not in new_cases:
            out.append(Comparison(key, o["median_ms"], None, None, None, "missing-in-new"))
    return out


def _compare_one(key, old: dict, new: dict, threshold: float) -> Comparison:
    spread = math.hypot(old["rel_spread"], new["rel_spread"])
    allowed = max(threshold, spread)
    change = new["median_ms"] / old["median_ms"] - 1.0
    if change > allowed:
        status = "regressed"
    elif -change / (1.0 + change) > allowed:  # faster by the same relative margin, measured from NEW
        status = "improved"
    elif change > threshold:  # slower past the threshold, but within the runs' spread: undecided
        status = "noisy"
    else:
        status = "same"
    return Comparison(key, old["median_ms"], new["median_ms"], change, allowed, status)


def format_comparison(rows: list[Comparison]) -> str:
    header = ("op", "shape", "dtype", "backend", "old us", "new us", "change", "noise", "status")
    lines = []
    for r in rows:
        op, shape, dtype, backend = r.key
        lines.append(
            (
                op,
                shape,
                dtype,
                backend,
                "-" if r.old_ms is None else f"{r.old_ms * 1e3:.1f}",
                "-" if r.new_ms is None else f"{r.new_ms * 1e3:.1f}",
                "-" if r.change is None else f"{100 * r.change:+.1f}%",
                "-" if r.allowed is None else f"±{100 * r.allowed:.1f}%",
                r.status.upper() if r.status in FAILING else r.status,
            )
        )
    text = aligned_table(header, lines).split("\n")
    statuses = (
        "regressed",
        "broken",
        "fell-back",
        "improved",
        "fixed",
        "noisy",
        "same",
        "missing-in-old",
        "missing-in-new",
        "error",
    )
    counts = {s: sum(r.status == s for r in rows) for s in statuses}
    text.append("")
    text.append(", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no cases")
    return "\n".join(text)


def exit_code(rows: list[Comparison], allow_missing: bool = False, strict: bool = False) -> int:
    """1 when anything regressed, broke or fell back, or (unless allow_missing) a case of OLD is missing
    from NEW, or (strict) a slow-down was too noisy to decide; else 0 (noise, improvements and new cases
    do not fail)."""
    failing = FAILING if allow_missing else (*FAILING, "missing-in-new")
    failing = (*failing, "noisy") if strict else failing
    return 1 if any(r.status in failing for r in rows) else 0
