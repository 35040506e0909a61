"""GPU probe: the fixed-shift LSE loop (FOLD) against the online-max loop, per tile plan.

FOLD is offered for d <= 16 and, with one column range per program, for 16 < d <= 64 (launch_plans). For each (n, d, precision) it builds a realistic state (5 Sinkhorn iterations, eps = 0.1,
randn clouds), then times one f-update (GPU time: 10 updates captured in a CUDA graph)
with the online loop on the default tiles and with FOLD on several tiles, and checks
every FOLD output against the online one (max relative difference; NaN fails). It also
times whole 10-iteration solves with FOLD on (the solver default) and off.

    python bench/probe_fold.py [--cases 8192:64:float32,...] [--tag T]
        -> bench/results/probe_fold[_T]_<device>.json
The probe turns FOLD on for the resident path whatever n (launch_plans.FOLD_PATHS); the
library only does so when the row blocks fill the GPU without the column split.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_median_ms, environment, graph_ms, write  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core import launch_plans  # noqa: E402
from torch_api.kernel_ops import clouds, lse_update, params  # noqa: E402

CASES = [(65536, 3, "tf32"), (65536, 3, "float32"), (8192, 3, "tf32"), (8192, 3, "float32")]
TILES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages) tried with FOLD
    "k16": [(64, 128, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (256, 64, 8, 2), (128, 64, 4, 2)],
    "resident": [(128, 32, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
}


def key_for(n, d, prec):
    """The GPU_LSE entry a FOLD launch of this size reads (so the sweep can override it)."""
    _, path = launch_plans._cross_term(d, prec)
    if (path, prec, "fold") in launch_plans.GPU_LSE:
        return (path, prec, "fold"), path
    small = (path, prec, "small") in launch_plans.GPU_LSE and n <= 8192
    return ((path, prec, "small") if small else (path, prec)), path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None, help="n:d:precision,... (default: the d = 3 cases)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    cases = CASES if not args.cases else [(int(n), int(d), p) for n, d, p in
                                          (c.split(":") for c in args.cases.split(","))]
    launch_plans.FOLD_PATHS = ("k16", "resident")
    rows = []
    eps = 0.1
    for n, d, prec in cases:
        torch.manual_seed(n + d)
        x, y = torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda")
        sol = torch_api.sinkhorn(x, y, epsilon=eps, min_iterations=5, max_iterations=5, inner_iterations=5,
                                 precision=prec)
        X, Y = clouds(x, y)
        prm = params(eps, 1.0, "cuda")
        la = torch.full((n,), -float(torch.log(torch.tensor(float(n)))), device="cuda")
        f, g = sol.f.contiguous(), sol.g.contiguous()
        ref, _ = lse_update(X, Y, g, prm, prec, logw_out=la)
        base = dict(n=n, d=d, precision=prec)
        t = graph_ms(lambda: lse_update(X, Y, g, prm, prec, logw_out=la))
        rows.append(dict(base, variant="online", plan="default", ms=t))
        print(rows[-1], flush=True)
        key, path = key_for(n, d, prec)
        default = dict(launch_plans.GPU_LSE[key])
        for bm, bn, w, st in TILES[path]:
            launch_plans.GPU_LSE[key] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            launch_plans.clear_cache()
            rec = dict(base, variant="fold", plan=[bm, bn, w, st])
            try:
                out, _ = lse_update(X, Y, g, prm, prec, logw_out=la, pold=f, compute_err=False, fold=True)
                diff = float(((out - ref).abs().max() / ref.abs().max()).item())
                rec.update(max_rel_diff_vs_online=diff, finite=bool(torch.isfinite(out).all()),
                           ms=graph_ms(lambda: lse_update(X, Y, g, prm, prec, logw_out=la, pold=f,
                                                          compute_err=False, fold=True)))
                # a bad prediction: every row takes the fallback
                bad, _ = lse_update(X, Y, g, prm, prec, logw_out=la, pold=f + 100.0, compute_err=False, fold=True)
                rec["fallback_max_rel_diff"] = float(((bad - ref).abs().max() / ref.abs().max()).item())
                rec["fallback_ms"] = graph_ms(lambda: lse_update(X, Y, g, prm, prec, logw_out=la, pold=f + 100.0,
                                                                 compute_err=False, fold=True))
            except Exception as exc:  # pragma: no cover - device dependent
                rec["error"] = repr(exc)[:300]
            rows.append(rec)
            print(rec, flush=True)
        launch_plans.GPU_LSE[key] = default
        launch_plans.clear_cache()
        # whole solves, 10 fixed iterations, FOLD on (solver default) and off
        for fold_on in (True, False):
            orig = launch_plans.lse_plan
            if not fold_on:
                launch_plans.lse_plan = lambda *a, fold=False: orig(*a, fold=False)
            try:
                def solve():
                    return torch_api.sinkhorn(x, y, epsilon=eps, min_iterations=10, max_iterations=10,
                                              inner_iterations=10, precision=prec)
                out = solve()
                t, _ = cuda_median_ms(solve, reps=5)
                rows.append(dict(base, variant="solve_fold" if fold_on else "solve_online", ms=t,
                                 cost=float(out.reg_ot_cost), f0=float(out.f[0])))
                print(rows[-1], flush=True)
            finally:
                launch_plans.lse_plan = orig
        X = Y = x = y = sol = None  # free before the next size
        torch.cuda.empty_cache()
    write("probe_fold" + (f"_{args.tag}" if args.tag else ""), {"env": environment(), "eps": eps, "results": rows})


if __name__ == "__main__":
    main()
