"""Plots of one area's result JSON: time per workload, ours against the peers, and the ratios.

    python bench/plot.py bench/results/<area>/<device>.json [...]   # writes <device>.png beside each

Left panel: median ms per workload (log scale), one bar per method (rows that failed their float64
gate or did not run are left out and listed under the figure). Right panel: each compared row's
``speedup`` (its ms over the ms of the row it is compared with; above 1, ours is faster).
Works from the JSON alone.
"""

from __future__ import annotations

import json
import os
import sys


def plot_file(path: str, out: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as fh:
        data = json.load(fh)
    rows = data.get("rows", [])
    labels = list(dict.fromkeys(f"{r['workload']}\n{r['label']}" for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ok = [r for r in rows if r.get("passed") is not False and r.get("ms")]
    left_out = sorted({f"{r['method']} ({r['label']})" for r in rows if r not in ok})
    ratios = [r for r in ok if r.get("speedup")]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(max(12, 1.2 * len(labels) + 8), max(5.5, 0.2 * len(ratios) + 2)))
    width = 0.8 / max(1, len(methods))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, method in enumerate(methods):
        pts = [(labels.index(f"{r['workload']}\n{r['label']}"), r["ms"]) for r in ok if r["method"] == method]
        if pts:
            ax_t.bar([i + (k - len(methods) / 2 + 0.5) * width for i, _ in pts], [ms for _, ms in pts], width,
                     label=method, color=colors[k % len(colors)], hatch="" if method.startswith("ours") else "//")
    ax_t.set(yscale="log", ylabel="median ms", title="time per workload")
    ax_t.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30, ha="right")
    ax_t.legend(fontsize=7)
    names = [f"{r['label']}: {r['method']} / {r['compare_to']}" for r in ratios]
    ax_r.barh(range(len(ratios)), [r["speedup"] for r in ratios],
              color=[colors[methods.index(r["method"]) % len(colors)] for r in ratios])
    ax_r.axvline(1.0, color="k", lw=0.8)
    ax_r.set_yticks(range(len(ratios)), names, fontsize=6)
    ax_r.set(xscale="log", xlabel="method ms / compared ms (> 1: ours faster)", title="ratio")
    ax_r.invert_yaxis()
    env = data.get("env", {})
    fig.suptitle(f"{data.get('area', '')}: {env.get('device', '?')}, {env.get('date', '')}", fontsize=10)
    if left_out:
        fig.text(0.01, 0.005, "not shown (failed the float64 gate or did not run): " + "; ".join(left_out)[:400],
                 fontsize=6, wrap=True)
    out = out or os.path.splitext(path)[0] + ".png"
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        print("wrote", plot_file(p))
