"""The report: ``<device>-<date>.json``, ``.md`` and ``.png`` in the output folder, and the
summary table printed at the end of a run.

JSON: {"device", "date", "versions", "suite", "thresholds", "elapsed_s", "rows": [...]}, each
row with frontend, quantity, case, error, threshold, passed, reference, note and the case's
n, m, d, eps, eps_rel, weights, cloud, precision. The markdown states the thresholds, embeds
the plot (error per quantity and case, log scale, each row's bound drawn) and lists every row.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
from typing import Sequence

from . import thresholds
from .compare import Row
from .quantities import QUANTITIES

PACKAGES = ("torch", "jax", "jaxlib", "triton", "ott-jax", "geomloss", "numpy")


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def _fmt(v: float) -> str:
    return "inf" if math.isinf(v) else ("nan" if math.isnan(v) else f"{v:.2e}")


def summary(rows: Sequence[Row]) -> str:
    """Per (frontend, group of quantities): rows, failures, worst error / its bound."""
    lines = [f"{'frontend':<7} {'quantity':<12} {'rows':>5} {'failed':>7} {'worst error/bound':>18}"]
    keys: dict[tuple[str, str], list[Row]] = {}
    order = {q.name: i for i, q in enumerate(QUANTITIES)}
    for r in sorted(rows, key=lambda r: (order.get(r.quantity, len(order)), r.frontend != "torch")):
        keys.setdefault((r.frontend, r.quantity), []).append(r)
    for (fe, q), rs in keys.items():
        worst = max((r.error / r.threshold if r.threshold > 0 else math.inf) for r in rs)
        lines.append(f"{fe:<7} {q:<12} {len(rs):>5} {sum(not r.passed for r in rs):>7} {_fmt(worst):>18}")
    failed = [r for r in rows if not r.passed]
    lines.append(f"{len(rows)} rows, {len(failed)} failed")
    for r in failed:
        lines.append(f"  FAILED {r.id}: error {_fmt(r.error)} > {_fmt(r.threshold)} ({r.reference}) {r.note}")
    return "\n".join(lines)


def _plot(rows: Sequence[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.quantity != "converged"]
    labels = sorted({r.quantity for r in shown}, key=[r.quantity for r in shown].index)
    cases = sorted({r.case for r in shown}, key=[r.case for r in shown].index)
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(labels)), 5.5))
    cmap = plt.get_cmap("tab20")
    for r in shown:
        i = labels.index(r.quantity)
        off = 0.18 if r.frontend == "jax" else -0.18
        err = r.error if math.isfinite(r.error) and r.error > 0 else (1e-17 if r.error == 0 else 1e3)
        ax.scatter(i + off, err, color=cmap(cases.index(r.case) % 20), marker="o" if r.frontend == "torch" else "s",
                   edgecolors="red" if not r.passed else "none", linewidths=1.5, s=26, zorder=3)
        ax.hlines(r.threshold, i + off - 0.15, i + off + 0.15, colors="black", linewidth=1.0, zorder=2)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right")
    ax.set_ylabel("relative error vs reference")
    ax.set_title("parity: error per quantity (o torch, s jax; colour = case; bar = row's bound; red edge = failed)",
                 fontsize=9)
    for k, c in enumerate(cases):
        ax.scatter([], [], color=cmap(k % 20), label=c)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(meta: dict, rows: Sequence[Row], png: str) -> str:
    th = meta["thresholds"]
    out = [f"# Parity report: {meta['device']}, {meta['date']}", "",
           f"Suite `{meta['suite']}`, {len(rows)} rows, {sum(not r.passed for r in rows)} failed, "
           f"{meta['elapsed_s']:.0f} s. Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
           *([f"", f"**Incomplete run:** {meta['incomplete']}."] if meta.get("incomplete") else []),
           "", "## Thresholds (parity/thresholds.py)", "",
           f"- Metric: {th['metric']}.",
           "- Base bounds: " + "; ".join(f"`{p}`: " + ", ".join(f"{k} {v:g}" for k, v in b.items())
                                         for p, b in th["base"].items()) + ".",
           *([f"- float32 potentials, costs, gradients: {th['float32_first_order']}, FLOOR_ULPS "
              f"{th['floor_ulps']:g} (no flat base)."] if "float32_first_order" in th else []),
           f"- Conditioning (other kinds): {th['conditioning']}, factor " +
           ", ".join(f"{k} {v:g}" for k, v in th["cond_factor"].items()) + ".",
           f"- Our solves at marginal error {th['solve_threshold']} (`converged` row: the solver's flag), "
           f"CG rtol {th['cg_rtol']:g}; OTT-JAX float64 at {th['ott_threshold']}.",
           f"- Cancellation: {th['cancellation']}, factor " +
           ", ".join(f"{k} {v:g}" for k, v in th["cancel_factor"].items()) + ".",
           *([f"- Stop gap: {th['stop_gap']}."] if "stop_gap" in th else []),
           f"- Stopping rule: at threshold {th['stop_check']['threshold']:g}, "
           f"{th['stop_check']['error']} <= {th['stop_check']['rtol']:g}.",
           "", f"![error per quantity and case]({png})", "", "## Rows", "",
           "| case | n | m | d | eps | weights | precision | frontend | quantity | error | bound | pass "
           "| reference | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.case} | {r.n} | {r.m} | {r.d} | {r.eps:.3g} | {r.weights} | {r.precision} | {r.frontend} "
                   f"| {r.quantity} | {_fmt(r.error)} | {_fmt(r.threshold)} | {'yes' if r.passed else '**NO**'} "
                   f"| {r.reference} | {r.note.replace('|', '/')} |")
    out.append("")
    return "\n".join(out)


def write(rows: Sequence[Row], out_dir: str, suite: str, elapsed_s: float,
          incomplete: str | None = None) -> dict[str, str]:
    """Write the JSON, markdown and PNG; returns their paths. ``incomplete``: why the run
    stopped early (recorded in both files)."""
    os.makedirs(out_dir, exist_ok=True)
    dev = device_name()
    date = datetime.date.today().isoformat()
    stem = os.path.join(out_dir, f"{slug(dev)}-{date}")
    meta = {"device": dev, "date": date, "versions": versions(), "suite": suite,
            "thresholds": thresholds.describe(), "elapsed_s": round(elapsed_s, 1), "incomplete": incomplete}
    with open(stem + ".json", "w") as fh:
        json.dump({**meta, "rows": [dataclasses.asdict(r) for r in rows]}, fh, indent=1,
                  default=lambda v: repr(v))
    _plot(rows, stem + ".png")
    with open(stem + ".md", "w") as fh:
        fh.write(_markdown(meta, rows, os.path.basename(stem) + ".png"))
    return {"json": stem + ".json", "md": stem + ".md", "png": stem + ".png"}
