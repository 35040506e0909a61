"""Tiles of the cluster-pair bound kernels (kernels/pair_bound.py) at the 2^20 solve's size (issue 15).

    python3 bench/probe_pair_bound_tiles.py

Clusters of a uniform cube of 2^20 points at the default cluster scale (0.04: 15 625 clusters per
cloud), fits of smooth potentials; times pair_keep + pair_fixup (with the transposed mask) and
pair_dropped (CUDA events, median of 20) for square tiles of 32 / 64 / 128 with 4 / 8 warps, and
checks that every tile gives the same keep mask and dropped-mass bound (to 1e-6) as the default.
Writes bench/results/probe_pair_bound_tiles_<device>.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from common import RESULTS, cuda_median_ms, environment  # noqa: E402

from ot_triton_jax.core import kernel_calls, launch_plans  # noqa: E402
from torch_api import multiscale_bounds as mb  # noqa: E402
from torch_api.multiscale_clusters import cluster_pair  # noqa: E402

EPS, TRUNCATE = 0.0025, 5.0


def main() -> int:
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    x, y = torch.rand(n, 3, generator=g).cuda(), torch.rand(n, 3, generator=g).cuda()
    a = torch.full((n,), 1.0 / n, device="cuda")
    cx, cy = cluster_pair(x, a, y, a, 0.04)
    xs, ys = x[cx.perm], y[cy.perm]
    gx, gy = mb.geometry(xs, a, cx), mb.geometry(ys, a, cy)
    f = 0.01 * torch.sin(3 * xs).sum(1) + 6.2 * EPS  # smooth, about the converged level ((f+g)/eps ~ 6.2)
    gpot = 0.01 * torch.cos(2 * ys).sum(1)
    fx, fy = mb.fit(gx, f), mb.fit(gy, gpot)
    original = launch_plans.pair_bound_plan
    rows, ref = [], None
    for blk, warps in [(64, 4), (32, 4), (64, 8), (128, 4), (128, 8)]:
        def plan(kx, ky, d, on_gpu, blk=blk, warps=warps):
            return launch_plans.LaunchPlan(grid=(-(-kx // blk), -(-ky // blk)), num_warps=warps, num_stages=1,
                                           constexprs={"BLOCK_K": blk, "BLOCK_L": blk, "D": d})
        launch_plans.pair_bound_plan = plan
        for fn in (kernel_calls.pair_keep, kernel_calls.pair_fixup, kernel_calls.pair_dropped):
            fn.cache_clear()
        try:
            keep, keep_t = mb.keep_pairs(gx, fx, gy, fy, EPS, TRUNCATE, transposed=True)
            dropped = float(mb.dropped_mass(gx, fx, gy, fy, EPS, keep))
            t_keep = cuda_median_ms(lambda: mb.keep_pairs(gx, fx, gy, fy, EPS, TRUNCATE, transposed=True), reps=20)[0]
            t_keep1 = cuda_median_ms(lambda: mb.keep_pairs(gx, fx, gy, fy, EPS, TRUNCATE), reps=20)[0]
            t_drop = cuda_median_ms(lambda: mb.dropped_mass(gx, fx, gy, fy, EPS, keep), reps=20)[0]
        finally:
            launch_plans.pair_bound_plan = original
        if ref is None:
            ref = (keep, dropped)
        row = {"block": blk, "warps": warps, "keep_pairs_transposed_ms": t_keep, "keep_pairs_ms": t_keep1,
               "dropped_mass_ms": t_drop, "kept": float(keep.float().mean()), "dropped": dropped,
               "same_keep": bool(torch.equal(keep, ref[0])), "transpose_exact": bool(torch.equal(keep_t, keep.t())),
               "dropped_rel_diff": abs(dropped - ref[1]) / max(abs(ref[1]), 1e-300)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for fn in (kernel_calls.pair_keep, kernel_calls.pair_fixup, kernel_calls.pair_dropped):
        fn.cache_clear()
    env = environment()
    path = os.path.join(RESULTS, f"probe_pair_bound_tiles_{env['device'].lower().replace(' ', '-')}.json")
    with open(path, "w") as fh:
        json.dump({"env": env, "clusters": [cx.k, cy.k], "rows": rows}, fh, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
