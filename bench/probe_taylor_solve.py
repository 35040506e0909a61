"""A/B of the multiscale solve with and without the Taylor pass (torch_api/multiscale_taylor.py,
bench/NOTES.md 94): the default call (loss + gradient in x, bench_multiscale.py's uniform clouds,
blur 0.05, scaling 0.5) with multiscale_taylor.MODE = "never" and "auto", alternating in one
process (median of CUDA-event times per round), the values' relative difference, the marginal
errors and dropped-mass bounds, the Taylor passes made, peak memory. Writes
bench/results/probe_taylor_solve_<device>.json.

    python3 bench/probe_taylor_solve.py [--sizes 262144,1048576,4194304] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from bench_multiscale import BLUR, SCALING, clouds  # noqa: E402
from common import cuda_median_ms, environment, write  # noqa: E402

import torch_api  # noqa: E402
from torch_api import multiscale_taylor  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="262144,1048576,4194304")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        x, y = clouds(n, "uniform")
        loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")
        xg = x.clone().requires_grad_(True)

        def call():
            xg.grad = None
            v = loss(xg, y)
            v.backward()
            return v

        row = {"n": n}
        for mode in ("never", "auto"):  # warm-up (compiles) and the reports
            multiscale_taylor.MODE = mode
            torch.cuda.reset_peak_memory_stats()
            v = call()
            torch.cuda.synchronize()
            st = loss.last_multiscale
            row[mode] = {"value": float(v), "grad": xg.grad.detach().clone(), "taylor_passes": st.taylor_passes,
                         "marginal_error": st.marginal_error, "dropped_mass_bound": st.dropped_mass_bound,
                         "sweeps": st.sweeps, "finish_sweeps": st.finish_sweeps,
                         "peak_mib": torch.cuda.max_memory_allocated() / 2 ** 20, "times_ms": []}
        for _ in range(3):  # alternating rounds
            for mode in ("never", "auto"):
                multiscale_taylor.MODE = mode
                row[mode]["times_ms"] += cuda_median_ms(call, reps=args.reps, warmup=0)[1]
        for mode in ("never", "auto"):
            row[mode]["ms"] = statistics.median(row[mode]["times_ms"])
        g0, g1 = row["never"].pop("grad"), row["auto"].pop("grad")
        row["value_rel_diff"] = abs(row["auto"]["value"] - row["never"]["value"]) / abs(row["never"]["value"])
        row["grad_rel_diff"] = float((g1 - g0).norm() / g0.norm())
        row["speedup"] = row["never"]["ms"] / row["auto"]["ms"]
        multiscale_taylor.MODE = "auto"
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x, y, xg, loss
        torch.cuda.empty_cache()
    write("probe_taylor_solve", {"env": environment(), "blur": BLUR, "scaling": SCALING, "rows": rows}, full_device_name=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
