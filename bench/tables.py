"""Markdown tables of result JSONs: per workload, our default call's median and each peer's
time as a multiple of it (above 1: ours is faster), with the float64 error of our row.

    python bench/tables.py bench/results/<area>/<device>.json [...]

Works from the JSON alone; the README's performance tables are its output.
"""

from __future__ import annotations

import json
import sys


def _fmt_ms(ms: float) -> str:
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def table(path: str) -> str:
    with open(path) as fh:
        data = json.load(fh)
    rows = [r for r in data.get("rows", []) if r.get("ms") and r.get("passed") is not False]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["workload"], r["label"]), []).append(r)
    lines = ["| workload | ours (ms) | error vs float64 | peers: their time / ours |", "|---|---|---|---|"]
    for (workload, label), rs in groups.items():
        ours = next((r for r in rs if r.get("ours") and r.get("default")), None)
        if ours is None:
            continue
        peers = [f"{r['method']} {r['ms'] / ours['ms']:.2f}x" for r in rs
                 if not r.get("ours") and r.get("compare_to") == ours["method"]]
        err = ours.get("error")
        lines.append(f"| {workload} {label} | {_fmt_ms(ours['ms'])} | {err:.1e} | {', '.join(peers) or '–'} |"
                     if err is not None else
                     f"| {workload} {label} | {_fmt_ms(ours['ms'])} | – | {', '.join(peers) or '–'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        print(f"{p}\n\n{table(p)}\n")
