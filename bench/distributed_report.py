"""The sharded-solve benchmark's results file: rows of both frontends in one JSON per device and
host size (bench/results/distributed/<device>-x<gpus>.json), and its plot (time and scaling
efficiency against the number of GPUs)."""

from __future__ import annotations

import json
import os

KEY = ("frontend", "n", "d", "mode", "gpus", "sharded")


def merge_rows(out: str, env: dict, frontend: str, method: str, rows: list[dict]) -> str:
    """Write ``rows`` (one frontend's) into the device's JSON, replacing the rows of the same
    workloads and keeping the others; returns the path written (rank 0 / the single process)."""
    name = env["device"].lower().replace(" ", "-")
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, f"{name}-x{env['gpus']}")
    data = dict(env={}, method={}, rows=[])
    if os.path.exists(base + ".json"):
        with open(base + ".json") as fh:
            data = json.load(fh)
    new = {tuple(r.get(k) for k in KEY) for r in rows}
    data["rows"] = [r for r in data["rows"] if tuple(r.get(k) for k in KEY) not in new] + rows
    with_single(data["rows"])
    data["rows"].sort(key=lambda r: (r["n"], r["d"], r["mode"], r["frontend"], r["sharded"], r["gpus"]))
    data.setdefault("env", {})[frontend] = env
    data.setdefault("method", {})[frontend] = method
    with open(base + ".json", "w") as fh:
        json.dump(data, fh, indent=1)
    plot(data["rows"], base + ".png")
    print("wrote", base + ".json", flush=True)
    return base + ".json"


def with_single(rows: list[dict]) -> None:
    """Fill ``ms_single`` and ``efficiency`` = t_1 / (P t_P) of the sharded rows from the
    single-device row of the same frontend and workload (timed in another process when a run
    skipped it), where that row exists."""
    single = {(r["frontend"], r["n"], r["d"], r["mode"]): r["ms"] for r in rows if not r["sharded"]}
    for r in rows:
        t1 = single.get((r["frontend"], r["n"], r["d"], r["mode"]))
        if r["sharded"] and t1 is not None:
            r.update(ms_single=t1, efficiency=t1 / (r["gpus"] * r["ms"]))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.5))
    groups = sorted({(r["frontend"], r["n"], r["d"], r["mode"]) for r in rows})
    colors = plt.get_cmap("tab20").colors
    top = 105.0
    for i, (fe, n, d, mode) in enumerate(groups):
        sel = [r for r in rows if (r["frontend"], r["n"], r["d"], r["mode"]) == (fe, n, d, mode)]
        one = [r for r in sel if not r["sharded"]]
        multi = sorted((r for r in sel if r["sharded"] and r["gpus"] > 1), key=lambda r: r["gpus"])
        if not multi:
            continue
        label = f"{fe} 2^{n.bit_length() - 1} d={d} {mode}"
        style = "-" if fe == "torch" else "--"
        pts = ([(1, one[0]["ms"])] if one else []) + [(r["gpus"], r["ms"]) for r in multi]
        ax_t.plot(*zip(*pts), style, marker="o", color=colors[i % len(colors)], label=label)
        if one:
            eff = [100.0] + [100 * r["efficiency"] for r in multi]
            top = max(top, max(eff) + 5)
            ax_e.plot([1] + [r["gpus"] for r in multi], eff, style, marker="o", color=colors[i % len(colors)],
                      label=label)
    ax_t.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="ms per call (synchronous)",
             title="sharded Sinkhorn: time")
    ax_e.set(xscale="log", xlabel="GPUs", ylabel="t(1) / (P t(P)) (%)", title="scaling efficiency", ylim=(50, top))
    for ax in (ax_t, ax_e):
        ax.set_xticks([1, 2, 4], ["1", "2", "4"])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_e.axhline(90, color="gray", lw=0.6, ls=":")
    ax_e.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
