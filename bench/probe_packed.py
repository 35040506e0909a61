"""GPU probe: packed FP16 operands (one product for d <= 5) and precomputed column biases, A/B.

Two changes to the LSE half-step (bench/NOTES.md 72), each switchable in the library:

* packed operands (launch_plans.packed_operands, PACKED_WIDTH = 0 turns them off): "fp16x3"
  issues three tensor-core products per tile and Triton waits for each; packed rows
  [x_lo, x_hi, x_hi] and columns [y_hi, y_lo, y_hi] give the same sum in one HGMMA k16;
* column biases once per half-step (launch_plans.COL_BIAS_MIN_M; a huge value turns it off):
  each thread of a tile otherwise recomputes b_j for its 16 columns from G, |y|^2 (and
  log-weights): ~24% of the FOLD loop's instructions at d = 3 (SASS, sm_90).

Per (n, d, precision): one FOLD f-update near the fixed point (10 captured in a CUDA graph) in
each of the four settings, then tiles for the new default, each against float64 on 512 rows
(max |f - f64| / max |f64|; NaN fails); then 10-iteration torch_api.sinkhorn solves (the
suite's bar workloads) before and after, in the same process on the same inputs.

    python bench/probe_packed.py [--cases 65536:3:float32,...] [--no-tiles] [--no-solves]
        -> bench/results/probe_packed_<device>.json
    python bench/probe_packed.py --paired 65536:64:tf32,...   (FOLD with two column tiles per
        step, lse.py PAIRED, and the online half-step's tiles) -> probe_packed_paired_<device>.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_median_ms, environment, graph_ms, write  # noqa: E402

import torch_api  # noqa: E402
import torch_api.cuda_graphs as graphs  # noqa: E402
from ot_triton_jax.core import kernel_calls, launch_plans  # noqa: E402
from torch_api.kernel_ops import clouds, lse_update, params  # noqa: E402

EPS = 0.1
CASES = "65536:3:float32,262144:3:float32,65536:3:tf32,65536:16:float32,65536:64:float32,65536:64:tf32,8192:3:float32,8192:64:float32"
SOLVES = ((65536, 3, "float32"), (262144, 3, "float32"), (65536, 64, "float32"), (65536, 64, "tf32"),
          (8192, 64, "float32"))
TILES = [(128, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2), (256, 64, 8, 2), (64, 64, 4, 2), (128, 32, 4, 2),
         (256, 32, 4, 2), (64, 128, 4, 3)]
SETTINGS = {"before": (0, 1 << 62), "packed": (16, 1 << 62), "col_bias": (0, 0), "packed+col_bias": (16, 0)}
DEFAULT = (launch_plans.PACKED_WIDTH, launch_plans.COL_BIAS_MIN_M)


def setting(width: int, min_m: int) -> None:
    launch_plans.PACKED_WIDTH, launch_plans.COL_BIAS_MIN_M = width, min_m
    launch_plans.clear_cache()
    for name in dir(kernel_calls):
        fn = getattr(kernel_calls, name)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    graphs.clear()


def f64_rows(x, y, g, rows, chunk=128):
    out = []
    n = x.shape[0]
    for k in range(0, rows.numel(), chunk):
        xs = x[rows[k:k + chunk]].double()
        C = torch.cdist(xs, y.double()) ** 2
        out.append(-EPS * torch.logsumexp((g.double()[None] - C) / EPS, dim=1) - EPS * torch.log(torch.tensor(float(n), dtype=torch.float64)))
    return torch.cat(out)


def near_fixed_point(case: str):
    """(n, d, precision, x, y, f, g, params, log a, 512 sampled rows) for "n:d:precision": randn
    clouds and the potentials after 5 default Sinkhorn iterations."""
    n, d, prec = case.split(":")
    n, d = int(n), int(d)
    gen = torch.Generator().manual_seed(n + d)
    x, y = torch.randn(n, d, generator=gen).cuda(), torch.randn(n, d, generator=gen).cuda()
    setting(*DEFAULT)
    sol = torch_api.sinkhorn(x, y, epsilon=EPS, min_iterations=5, max_iterations=5, inner_iterations=5, precision=prec)
    la = torch.full((n,), -float(torch.log(torch.tensor(float(n)))), device="cuda")
    sample = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:512].cuda()
    return n, d, prec, x, y, sol.f.contiguous(), sol.g.contiguous(), params(EPS, 1.0, "cuda"), la, sample


def half_steps(cases, tiles: bool) -> list[dict]:
    rows = []
    for case in cases.split(","):
        n, d, prec, x, y, f, g, prm, la, sample = near_fixed_point(case)
        ref = None
        for name, cfg in SETTINGS.items():
            setting(*cfg)
            X, Y = clouds(x, y)
            if ref is None:
                ref = f64_rows(X.x, Y.x, g, sample)

            def record(variant, plan, fn):
                out = fn()
                err = float(((out[sample].double() - ref).abs().max() / ref.abs().max()).item())
                rec = dict(n=n, d=d, precision=prec, variant=variant, plan=plan, ms=graph_ms(fn), f_err=err,
                           finite=bool(torch.isfinite(out).all()))
                rows.append(rec)
                print(rec, flush=True)

            def update():
                return lse_update(X, Y, g, prm, prec, logw_out=la, pold=f, compute_err=False, fold=True)[0]

            record(name, "default", update)
            if tiles and name == "packed+col_bias" and n >= 65536:
                _, path = launch_plans._cross_term(d, prec)
                key = next(k for k in ((path, prec, "fold"), (path, prec)) if k in launch_plans.GPU_LSE)
                default = dict(launch_plans.GPU_LSE[key])
                for bm, bn, nw, st in TILES:
                    launch_plans.GPU_LSE[key] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=st)
                    setting(*cfg)
                    try:
                        record(name, [bm, bn, nw, st], update)
                    except Exception as exc:  # pragma: no cover - device dependent
                        rows.append(dict(n=n, d=d, precision=prec, variant=name, plan=[bm, bn, nw, st], error=repr(exc)[:300]))
                        print(rows[-1], flush=True)
                launch_plans.GPU_LSE[key] = default
            X = Y = None
        setting(*DEFAULT)
        x = y = None
        torch.cuda.empty_cache()
    return rows


PAIRED_TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 2), (128, 64, 4, 2), (64, 128, 4, 2)]
ONLINE_TILES = [(256, 64, 8, 2), (64, 128, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2), (128, 128, 8, 2)]


def paired(cases) -> list[dict]:
    """FOLD with two column tiles per loop step (lse.py PAIRED) against one, and the online
    half-step (the solve's first g-update and its final measuring one) at several tiles."""
    rows = []
    for case in cases.split(","):
        n, d, prec, x, y, f, g, prm, la, sample = near_fixed_point(case)
        X, Y = clouds(x, y)
        ref = f64_rows(X.x, Y.x, g, sample)
        _, path = launch_plans._cross_term(d, prec)
        for fold, tiles, key in ((True, PAIRED_TILES, next(k for k in ((path, prec, "fold"), (path, prec)) if k in launch_plans.GPU_LSE)),
                                 (False, ONLINE_TILES, (path, prec))):
            default = dict(launch_plans.GPU_LSE[key])
            for tile in [None] + tiles:
                for pair in ((False, True) if fold else (False,)):
                    cfg = dict(default) if tile is None else dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), tile))
                    if pair:
                        cfg["PAIRED"] = True
                    launch_plans.GPU_LSE[key] = cfg
                    setting(*DEFAULT)

                    def update():
                        return lse_update(X, Y, g, prm, prec, logw_out=la, pold=f, compute_err=not fold, fold=fold)[0]
                    rec = dict(n=n, d=d, precision=prec, fold=fold, paired=pair, plan=tile or "default")
                    try:
                        out = update()
                        rec.update(ms=graph_ms(update), finite=bool(torch.isfinite(out).all()),
                                   f_err=float(((out[sample].double() - ref).abs().max() / ref.abs().max()).item()))
                    except Exception as exc:  # pragma: no cover - device dependent
                        rec["error"] = repr(exc)[:300]
                    rows.append(rec)
                    print(rec, flush=True)
            launch_plans.GPU_LSE[key] = default
            setting(*DEFAULT)
        X = Y = x = y = None
        torch.cuda.empty_cache()
    return rows


def solves() -> list[dict]:
    rows = []
    for n, d, prec in SOLVES:
        gen = torch.Generator().manual_seed(n + d)
        x, y = torch.randn(n, d, generator=gen).cuda(), torch.randn(n, d, generator=gen).cuda()
        for name in ("before", "packed+col_bias"):
            setting(*SETTINGS[name])

            def solve():
                return torch_api.sinkhorn(x, y, epsilon=EPS, min_iterations=10, max_iterations=10, inner_iterations=10,
                                          precision=prec)
            out = solve()
            t, _ = cuda_median_ms(solve, reps=5)
            rows.append(dict(n=n, d=d, precision=prec, variant=name, solve_10it_ms=t, cost=float(out.reg_ot_cost),
                             f0=float(out.f[0]), finite=bool(torch.isfinite(out.f).all())))
            print(rows[-1], flush=True)
        setting(*DEFAULT)
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--no-tiles", action="store_true")
    ap.add_argument("--no-solves", action="store_true")
    ap.add_argument("--paired", default="", help="cases for paired(); only that part runs")
    args = ap.parse_args()
    if args.paired:
        write("probe_packed_paired", {"env": environment(), "eps": EPS, "rows": paired(args.paired)})
        return
    rows = half_steps(args.cases, not args.no_tiles)
    solve_rows = [] if args.no_solves else solves()
    write("probe_packed", {"env": environment(), "eps": EPS, "settings": SETTINGS, "half_steps": rows,
                           "solves": solve_rows})


if __name__ == "__main__":
    main()
