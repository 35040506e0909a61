"""GPU probe: the mass term of reg_ot_cost with an unbiased cross term.

The tensor cores' truncating accumulation shrinks <x, y> by a relative kappa (~1.5e-7 at
d = 64, bench/NOTES.md item 17), which biased the float32 cost (1.2e-7 relative against 3.3e-8
for OTT-JAX). The reported cost is the dual objective, stationary in (f, g), so evaluating
its mass term sum P with an unbiased <x, y> removes the bias to first order. Two ways:

* "fixed4" (the library's kernel_calls.exact_row_mass): heads on a per-row fixed-point grid
  (kernels/split.py, their products sum exactly), four TF32 products in two accumulators;
  several tiles of launch_plans.GPU_MASS (column split as planned);
* "ieee" (--ieee): apply_plan_kernel's row sums with PRECISION "ieee" (float32 FMAs on the
  CUDA cores), two tiles (the first version; 0.54-1.5 ms at n = 8192, d = 64: too slow).

For each: GPU time of one pass (CUDA graph) against the tensor-core "tf32x3" row-sum pass,
and the relative error of eps * sum P against float64, relative to the cost. Then the cost of
100-iteration torch_api.sinkhorn solves against float64, with the library's mass term and with
sum P = sum a (the earlier cost).

    python bench/probe_exact_mass.py [--sizes 8192x64,65536x64,8192x3] [--solve 8192x64,8192x128]
        -> bench/results/probe_exact_mass[_T]_<device>.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, f64_sinkhorn, graph_ms, write  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core import launch_plans  # noqa: E402
from ot_triton_jax.core.kernels import apply_plan_kernel  # noqa: E402
from torch_api.kernel_ops import Cloud, apply_plan, clouds, exact_row_mass, params  # noqa: E402

EPS = 0.1
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: interpreter smoke run
MASS_TILES = [
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3),
]
IEEE = False  # --ieee: also the float32-FMA pass (first version, bench/results/probe_exact_mass_v1_h100.json)
IEEE_TILES = [
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=16, num_warps=4, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, num_warps=4, num_stages=2),
]


def ieee_row_mass(X: Cloud, Y: Cloud, f, g, prm, cfg):
    """apply_plan_kernel's row sums with float32 FMAs on the original points."""
    cfg = dict(cfg)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    n, m, d = X.n, Y.n, X.d
    rows = torch.empty(n, device=X.x.device)
    ce = {**cfg, "SINGLE_K": cfg["BLOCK_K"] >= d, "PRECISION": "ieee", "BLOCK_P": 8, "P_FMA": 0, "HAS_V": False,
          "D": d, "P": 0, **launch_plans.size_hints(n=n, m=m)}
    apply_plan_kernel[(triton.cdiv(n, cfg["BLOCK_M"]), 1)](
        X.x, X.x, Y.x, Y.x, X.sqnorm, Y.sqnorm, f, g, prm, prm, n, m, rows, rows,
        num_warps=warps, num_stages=stages, **ce)
    return rows


def f64_mass(x, y, f, g, chunk=2048):
    X, Y = x.double(), y.double()
    yn = (Y * Y).sum(1)
    total = 0.0
    for i in range(0, X.shape[0], chunk):
        xs = X[i:i + chunk]
        C = (xs * xs).sum(1)[:, None] + yn[None] - 2 * xs @ Y.T
        total += float(torch.exp((f[i:i + chunk].double()[:, None] + g.double()[None] - C) / EPS).sum())
    return total


def timing(n, d, out):
    torch.manual_seed(n + d)
    x, y = torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV)
    sol = torch_api.sinkhorn(x, y, epsilon=EPS, min_iterations=20, max_iterations=20)
    f, g = sol.f, sol.g
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, DEV)
    ref = f64_mass(x, y, f, g)
    cost = float(sol.reg_ot_cost)
    row = dict(part="timing", n=n, d=d, mass_f64=ref, cost=cost)
    _, rows = apply_plan(X, Y, f, g, prm, "float32")
    row["tc_x3_ms"] = graph_ms(lambda: apply_plan(X, Y, f, g, prm, "float32"))
    row["tc_x3_cost_rel_err"] = EPS * abs(float(rows.double().sum()) - ref) / abs(cost)
    rows = exact_row_mass(X, Y, f, g, prm)
    row["fixed4_plan"] = dict(grid=launch_plans.exact_mass_plan(n, n, d, True).grid)
    row["fixed4_ms"] = graph_ms(lambda: exact_row_mass(X, Y, f, g, prm))
    row["fixed4_cost_rel_err"] = EPS * abs(float(rows.double().sum()) - ref) / abs(cost)
    path = launch_plans._cross_term(d, "float32")[1]
    default = dict(launch_plans.GPU_MASS[path])
    row["fixed4_tiles"] = []
    for cfg in MASS_TILES:
        launch_plans.GPU_MASS[path] = dict(cfg)
        launch_plans.clear_cache()
        rows = exact_row_mass(X, Y, f, g, prm)
        ms = graph_ms(lambda: exact_row_mass(X, Y, f, g, prm))
        row["fixed4_tiles"].append(dict(cfg=cfg, split=launch_plans.exact_mass_plan(n, n, d, True).grid[1], ms=ms,
                                        cost_rel_err=EPS * abs(float(rows.double().sum()) - ref) / abs(cost)))
        print(row["fixed4_tiles"][-1], flush=True)
    launch_plans.GPU_MASS[path] = default
    launch_plans.clear_cache()
    if IEEE:
        row["ieee"] = []
        for cfg in IEEE_TILES:
            rows = ieee_row_mass(X, Y, f, g, prm, cfg)
            ms = graph_ms(lambda: ieee_row_mass(X, Y, f, g, prm, cfg))
            row["ieee"].append(dict(cfg=cfg, ms=ms,
                                    cost_rel_err=EPS * abs(float(rows.double().sum()) - ref) / abs(cost)))
            print(row["ieee"][-1], flush=True)
    out.append(row)
    print({k: v for k, v in row.items() if k not in ("ieee", "fixed4_tiles")}, flush=True)


def solve_accuracy(n, d, out, iters=100):
    torch.manual_seed(0)
    x, y = torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV)
    _, _, cref = f64_sinkhorn(x, y, iters, EPS)
    sol = torch_api.sinkhorn(x, y, epsilon=EPS, min_iterations=iters, max_iterations=iters)
    f, g = sol.f.double(), sol.g.double()
    la = math.log(1.0 / n)
    old = float((f.mean() - EPS * la) + (g.mean() - EPS * la))  # sum P = sum a
    out.append(dict(part="solve", n=n, d=d, iters=iters, cost_f64=cref,
                    err_cost_library=abs(float(sol.reg_ot_cost) - cref) / abs(cref),
                    err_cost_mass_sum_a=abs(old - cref) / abs(cref)))
    print(out[-1], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8192x64,65536x64,8192x3")
    ap.add_argument("--solve", default="8192x64,8192x128")
    ap.add_argument("--tag", default="")
    ap.add_argument("--ieee", action="store_true")
    args = ap.parse_args()
    global IEEE
    IEEE = args.ieee
    out = []
    for s in filter(None, args.solve.split(",")):
        n, d = map(int, s.split("x"))
        solve_accuracy(n, d, out)
    for s in filter(None, args.sizes.split(",")):
        n, d = map(int, s.split("x"))
        timing(n, d, out)
    name = "probe_exact_mass" + (f"_{args.tag}" if args.tag else "")
    print(write(name, {"env": environment(), "eps": EPS, "results": out}))


if __name__ == "__main__":
    main()
