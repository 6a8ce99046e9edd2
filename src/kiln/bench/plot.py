"""Roofline plot of a `kiln bench` result (matplotlib, Agg backend: no display needed).

x: arithmetic intensity (FLOP/byte), y: achieved FLOP/s, log-log. The measured ceilings are drawn as
the bandwidth line (y = bandwidth * x) and one flat line per measured matmul dtype; each case is a point.
"""

from __future__ import annotations

from pathlib import Path


def plot_roofline(payload: dict, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = payload["ceilings"]
    bandwidth = ceil["bandwidth_gbs"] * 1e9
    cases = [c for c in payload["cases"] if not c["error"] and c["flops"] > 0 and c["bytes"] > 0]
    peaks = {name: tflops * 1e12 for name, tflops in ceil["matmul_tflops"].items()}
    top = max(peaks.values())
    xs = [c["intensity"] for c in cases]
    x_lo = min([*xs, 0.01 * top / bandwidth]) / 2
    x_hi = max([*xs, 100 * top / bandwidth]) * 2
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(
        [x_lo, top / bandwidth],
        [bandwidth * x_lo, top],
        color="black",
        lw=1.5,
        label=f"memory {ceil['bandwidth_gbs']:.0f} GB/s",
    )
    for name, peak in sorted(peaks.items(), key=lambda item: -item[1]):
        ax.plot(
            [peak / bandwidth, x_hi],
            [peak, peak],
            lw=1.5,
            ls="-" if peak == top else "--",
            label=f"{name} matmul {peak / 1e12:.3g} TFLOP/s",
        )
    markers = "osD^v<>pP*X"
    for i, op in enumerate(sorted({c["op"] for c in cases})):
        mine = [c for c in cases if c["op"] == op]
        ax.scatter(
            [c["intensity"] for c in mine],
            [c["tflops"] * 1e12 for c in mine],
            marker=markers[i % len(markers)],
            s=36,
            label=op,
            zorder=3,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved FLOP/s")
    meta = payload["metadata"]
    ax.set_title(f"Roofline: {meta['device_name']} ({meta['timing']}, {meta['date'][:10]})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
