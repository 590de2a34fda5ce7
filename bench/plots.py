"""PNG figures of a report: TTFT and TPOT against closed-loop concurrency, one line per mode."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {"alone": ("tab:gray", "o"), "async": ("tab:blue", "s"), "sync": ("tab:orange", "^")}
HF_STYLE = {"hf": ("black", ":"), "hf_ngram": ("tab:green", "--"), "hf_model": ("tab:purple", "--")}


def plot_latency(report: dict, out: Path) -> list[Path]:
    """One PNG per drafter: rows are temperatures, columns TTFT and TPOT. Markers are p50 and the
    band spans p50 to p90. Log y axes. HF runs one request at a time, so it is a flat line at its c=1 value."""
    paths = []
    cells = [c for c in report["cells"] if c["arrivals"]["kind"] == "closed"]
    for drafter in sorted({c["drafter"] for c in cells}):
        mine = [c for c in cells if c["drafter"] == drafter]
        temperatures = sorted({c["temperature"] for c in mine})
        fig, axes = plt.subplots(len(temperatures), 2, figsize=(11, 3.6 * len(temperatures)), squeeze=False)
        for row, temperature in zip(axes, temperatures):
            at = [c for c in mine if c["temperature"] == temperature]
            concurrencies = sorted({c["arrivals"]["concurrency"] for c in at})
            for ax, figure, title in ((row[0], "ttft_s", "TTFT"), (row[1], "tpot_s", "TPOT")):
                for mode, (color, marker) in STYLE.items():
                    points = sorted((c["arrivals"]["concurrency"], c["summary"][figure]) for c in at if c["mode"] == mode)
                    if not points:
                        continue
                    xs = [x for x, _ in points]
                    p50 = [s["p50"] * 1000 for _, s in points]
                    p90 = [s["p90"] * 1000 for _, s in points]
                    ax.plot(xs, p50, marker=marker, color=color, label=f"{mode} p50")
                    ax.fill_between(xs, p50, p90, color=color, alpha=0.15)
                for mode, (color, dash) in HF_STYLE.items():
                    for c in at:
                        if c["mode"] == mode and c["summary"][figure]["p50"] is not None:
                            ax.axhline(c["summary"][figure]["p50"] * 1000, color=color, linestyle=dash,
                                       label=f"{mode.replace('_', ' ')} p50 (sequential)")
                ax.set_xscale("log", base=2)
                ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
                ax.set_xlabel("concurrency (closed loop)")
                ax.set_ylabel(f"{title} (ms, log scale)")
                ax.set_yscale("log")  # the modes differ by 10x or more: a linear axis flattens the fast ones
                ax.set_title(f"{title}, T={temperature:g}, {drafter} drafter (band: p50 to p90)")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        fig.suptitle(f"Tandem: {report['command']}", fontsize=9)
        fig.tight_layout()
        path = out / f"latency_{drafter}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
