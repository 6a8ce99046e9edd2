"""Printing a profile: the per-kernel table and the utilization-gap report.

The gap of a kernel is time x (1 - roofline fraction of its op): the time that better kernels could
win back. Kernels with no known fraction count their whole time (marked "?"), so unknown work is never
hidden at the bottom.
"""

from __future__ import annotations

from kiln.profile.profiler import KernelRow, ProfileReport
from kiln.text_table import aligned_table


def _name(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _fraction(row: KernelRow) -> str:
    return "?" if row.fraction is None else f"{100 * row.fraction:.1f}%"


def format_kernels(report: ProfileReport, top: int = 30) -> str:
    """Kernels by total time: calls, total, share, mapped op and its % of roofline."""
    rows = [
        (_name(r.name), str(r.calls), f"{r.total_us:.1f}", f"{100 * r.share:.1f}%", r.op or "-", _fraction(r))
        for r in report.kernels[:top]
    ]
    header = ("kernel", "calls", "total us", "share", "op", "% roofline")
    text = aligned_table(header, rows)
    hidden = len(report.kernels) - top
    total = f"\n{len(report.kernels)} kernels, {report.total_us:.1f} us total on {report.device}"
    return text + (f"\n({hidden} more kernels not shown)" if hidden > 0 else "") + total


def format_ops(report: ProfileReport) -> str:
    rows = [
        (
            op,
            str(e["calls"]),
            f"{e['time_us']:.1f}",
            f"{e['bound_us']:.2f}",
            "?" if e["fraction"] is None else f"{100 * e['fraction']:.1f}%",
        )
        for op, e in report.ops.items()
    ]
    return aligned_table(("op", "calls", "kernel us", "roofline us", "% roofline"), rows) if rows else ""


def format_gaps(report: ProfileReport, top: int = 15) -> str:
    """Kernels ranked by gap = time x (1 - roofline fraction), with the running share of all gaps."""
    ranked = sorted(report.kernels, key=lambda r: -r.gap_us)[:top]
    total_gap = sum(r.gap_us for r in report.kernels) or 1.0
    running, rows = 0.0, []
    for r in ranked:
        running += r.gap_us
        rows.append(
            (
                _name(r.name),
                f"{r.gap_us:.1f}",
                f"{r.total_us:.1f}",
                _fraction(r),
                f"{100 * running / total_gap:.1f}%",
            )
        )
    return aligned_table(("kernel", "gap us", "time us", "% roofline", "cumulative gap"), rows)
