"""Plot a bench_peers JSON (``--json``) as a PNG: rows/s and per-batch latency p50/p99
per system, one group per micro-batch size. Runs in the peers' virtual environment
(matplotlib is installed there by `make bench-peers`).

    plot.py peers.json docs/performance.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen


def main(source: Path, target: Path) -> None:
    data = json.loads(source.read_text())
    results = data["results"]
    sizes = sorted({r["batch"] for r in results})
    systems = list(dict.fromkeys(r["system"] for r in results))
    by = {(r["system"], r["batch"]): r for r in results}
    fig, (rate, latency) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [s + i * width for s in range(len(sizes))]
        rows = [by.get((system, b), {}).get("rows_per_s") or 0 for b in sizes]
        p50 = [by.get((system, b), {}).get("p50_ms") or 0 for b in sizes]
        p99 = [by.get((system, b), {}).get("p99_ms") or 0 for b in sizes]
        rate.bar(xs, rows, width, label=system)
        latency.bar(xs, p50, width, label=f"{system} p50")
        latency.scatter(xs, p99, marker="_", s=200, color="black")
    for ax, title, unit in ((rate, "throughput", "rows/s (log)"),
                            (latency, "per-batch latency (bar p50, dash p99)", "ms (log)")):
        ax.set_xticks([s + 0.4 - width / 2 for s in range(len(sizes))])
        ax.set_xticklabels([f"B={b}" for b in sizes])
        ax.set_yscale("log")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    rate.legend(fontsize=8)
    setup = data["setup"]
    fig.suptitle(f"{setup['rows']} changes (70/20/10), seed {setup['seed']}; "
                 f"{setup['cores']} cores; {setup['peers']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
