"""Markdown report of a `kiln bench` result: header with device and ceilings, one table row per case."""

from __future__ import annotations

import json
from pathlib import Path


def _shape(shape: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def _us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def format_markdown(payload: dict) -> str:
    meta, ceil = payload["metadata"], payload["ceilings"]
    tflops = ", ".join(f"{k} {v:.2f}" for k, v in ceil["matmul_tflops"].items())
    lines = [
        f"# kiln bench: {meta['device_name']} ({meta['timing']})",
        "",
        f"- date {meta['date']}, git {str(meta['git_commit'])[:12]}{' (dirty)' if meta['git_dirty'] else ''}",
        f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, driver {meta['driver']}, "
        f"jax {meta['jax']}",
        f"- backend: {meta.get('backend', 'dispatch')}, shapes: {meta['suite']}",
        f"- measured ceilings: {ceil['bandwidth_gbs']:.1f} GB/s, matmul TFLOP/s: {tflops} ({ceil['method']})",
    ]
    taken = meta.get("environment", {}).get("fallbacks", [])
    lines += [f"- FALLBACK taken: {entry['kind']} ({entry['detail']})" for entry in taken]
    lines.append("")
    baseline_names = sorted({name for case in payload["cases"] for name in case["baselines"]})
    header = [
        "op",
        "shape",
        "dtype",
        "backend",
        "median us",
        "p20-p80 us",
        "TFLOP/s",
        "GB/s",
        "% roofline",
        "bound",
    ] + [f"vs {name}" for name in baseline_names]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case in payload["cases"]:
        backend = case["backend"] + (" (FALLBACK)" if case.get("fallback") else "")
        row = [case["op"], _shape(case["shape"]), case["dtype"], backend]
        if case["error"]:
            row += [f"error: {case['error'][:80]}"] + [""] * (len(header) - 5)
        else:
            row += [
                _us(case["median_ms"]),
                f"{_us(case['p20_ms'])}-{_us(case['p80_ms'])}",
                f"{case['tflops']:.3f}",
                f"{case['gbps']:.1f}",
                _percent_of_roofline(case["roofline_fraction"], case["limiter"]),
                case["limiter"],
            ]
            for name in baseline_names:
                base = case["baselines"].get(name)
                if base is None:
                    row.append("")
                elif "error" in base:
                    row.append("error")
                else:  # a baseline timed by another method than Kiln's kernel says so
                    other = base.get("method") not in (None, case.get("method"))
                    row.append(f"{base['speedup']:.2f}x" + (f" ({base['method']})" if other else ""))
        lines.append("| " + " | ".join(str(cell).replace("|", "/") for cell in row) + " |")
    lines.append("")
    lines.append(
        "Speed-up = baseline median / Kiln median (>1 means Kiln is faster). "
        "% roofline = max(flops/peak, bytes/bandwidth) / measured; over 100% (cached) means the rotated "
        "inputs stayed in cache, (ceiling too low) that the measured compute ceiling is. "
        "A speed-up marked with a timing method (e.g. eager) timed the baseline "
        "otherwise than Kiln's kernel (a baseline that syncs with the host cannot be graph-replayed)."
    )
    return "\n".join(lines) + "\n"


def _percent_of_roofline(fraction: float, limiter: str = "memory") -> str:
    """Over 100%: memory-bound, the inputs stayed in cache (the case's rotated_bytes); compute-bound,
    the measured compute ceiling is below what the kernel ran at (re-measure: --refresh-ceilings).
    Neither is a kernel beating the bound."""
    if fraction <= 1:
        return f"{100 * fraction:.1f}%"
    return f"{100 * fraction:.1f}%" + (" (cached)" if limiter == "memory" else " (ceiling too low)")


def write_markdown(payload: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(format_markdown(payload))
    return path


def load_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
