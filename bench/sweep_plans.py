"""Tile sweep for the LSE and plan-apply kernels on the GPU (input to launch_plans.GPU_* tables).

Times one LSE half-step (n = m = 65536) and one P@Y apply pass for several (BLOCK_M, BLOCK_N,
num_warps, num_stages) choices, for d = 3 and d = 64 (both on the "resident" path) and precision, and checks each
result against the default plan's output (a wrong tile choice must not pass silently).

    python bench/sweep_plans.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_median_ms, environment, write  # noqa: E402

import torch_api  # noqa: E402,F401
from ot_triton_jax.core import launch_plans  # noqa: E402
from torch_api.kernel_ops import apply_plan, clouds, lse_update, params  # noqa: E402

LSE_CANDIDATES = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3),
                  (128, 32, 4, 3), (256, 64, 8, 2), (64, 32, 4, 4)]
K16_CANDIDATES = [  # d = 3 (zero-padded to BLOCK_K = 16)
   (128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 1), (64, 128, 4, 2), (256, 64, 8, 2),
                  (32, 128, 4, 2), (128, 32, 4, 2)]
APPLY_CANDIDATES = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3), (64, 128, 8, 2)]


SMALL_CANDIDATES = [(128, 32, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2)]


def sweep_small(n=8192, d=64):
    """n = m = 8192: tiles x column split (the split is what fills the GPU at this size)."""
    torch.manual_seed(1)
    X, Y = clouds(torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda"))
    g = torch.randn(n, device="cuda")
    prm = params(0.1, 1.0, "cuda")
    rows = []
    auto_split = launch_plans._column_split
    for prec in ("float32", "tf32"):
        ref, _ = lse_update(X, Y, g, prm, prec)
        default = dict(launch_plans.GPU_LSE[("resident", prec)])
        for bm, bn, w, st in SMALL_CANDIDATES:
            for split in (1, 2, 4, 8, 16):
                launch_plans.GPU_LSE[("resident", prec)] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
                launch_plans._column_split = lambda *a, _s=split: _s
                launch_plans.clear_cache()
                try:
                    res, _ = lse_update(X, Y, g, prm, prec)
                    err = float((res - ref).abs().max() / ref.abs().max())
                    t, _ = cuda_median_ms(lambda: lse_update(X, Y, g, prm, prec), reps=20)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(10):
                            lse_update(X, Y, g, prm, prec)
                    tg, _ = cuda_median_ms(graph.replay, reps=10)
                    rec = dict(kernel="lse_small", n=n, d=d, precision=prec, BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                               num_stages=st, split=split, ms=t, graph_ms=tg / 10, max_rel_diff_vs_default=err)
                except Exception as exc:
                    rec = dict(kernel="lse_small", n=n, d=d, precision=prec, BLOCK_M=bm, BLOCK_N=bn,
                               num_warps=w, num_stages=st, split=split, error=repr(exc)[:200])
                print(rec, flush=True)
                rows.append(rec)
        launch_plans.GPU_LSE[("resident", prec)] = default
        launch_plans._column_split = auto_split
        launch_plans.clear_cache()
    return rows


def main():
    if "--small" in sys.argv:
        rows = sweep_small()
        write("sweep_plans_small", {"env": environment(), "results": rows})
        for prec in ("float32", "tf32"):
            ok = [r for r in rows if "graph_ms" in r and r["precision"] == prec]
            for r in sorted(ok, key=lambda r: r["graph_ms"])[:3]:
                print("BEST", prec, r)
        return
    n = 65536
    out = []
    for d, key, cands in ((3, "k16", K16_CANDIDATES), (64, "resident", LSE_CANDIDATES)):
        torch.manual_seed(d)
        X, Y = clouds(torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda"))
        g = torch.randn(n, device="cuda")
        prm = params(0.1, 1.0, "cuda")
        for prec in ("float32", "tf32"):
            default = dict(launch_plans.GPU_LSE[(key, prec)])
            ref, _ = lse_update(X, Y, g, prm, prec)
            for bm, bn, w, s in cands:
                launch_plans.GPU_LSE[(key, prec)] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                launch_plans.clear_cache()
                try:
                    res, _ = lse_update(X, Y, g, prm, prec)
                    err = float((res - ref).abs().max() / ref.abs().max())
                    t, _ = cuda_median_ms(lambda: lse_update(X, Y, g, prm, prec), reps=5)
                    rec = dict(kernel="lse", d=d, precision=prec, BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                               num_stages=s, ms=t, max_rel_diff_vs_default=err)
                except Exception as exc:
                    rec = dict(kernel="lse", d=d, precision=prec, BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                               num_stages=s, error=repr(exc)[:200])
                print(rec, flush=True)
                out.append(rec)
            launch_plans.GPU_LSE[(key, prec)] = default
            launch_plans.clear_cache()
        # apply pass (gradient) in float32, with potentials from a short solve (a realistic plan)
        sol = torch_api.sinkhorn(X.x, Y.x, epsilon=0.1, min_iterations=3, max_iterations=3, inner_iterations=3)
        f, g = sol.f, sol.g
        default = dict(launch_plans.GPU_APPLY[key])
        ref, _ = apply_plan(X, Y, f, g, prm, "float32", Y.x)
        for bm, bn, w, s in APPLY_CANDIDATES:
            launch_plans.GPU_APPLY[key] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
            launch_plans.clear_cache()
            try:
                res, _ = apply_plan(X, Y, f, g, prm, "float32", Y.x)
                err = float((res - ref).abs().max() / ref.abs().max())
                t, _ = cuda_median_ms(lambda: apply_plan(X, Y, f, g, prm, "float32", Y.x), reps=5)
                rec = dict(kernel="apply", d=d, precision="float32", BLOCK_M=bm, BLOCK_N=bn, num_warps=w,
                           num_stages=s, ms=t, max_rel_diff_vs_default=err)
            except Exception as exc:
                rec = dict(kernel="apply", d=d, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s,
                           error=repr(exc)[:200])
            print(rec, flush=True)
            out.append(rec)
        launch_plans.GPU_APPLY[key] = default
        launch_plans.clear_cache()
    write("sweep_plans", {"env": environment(), "n": n, "results": out})
    best = {}
    for r in out:
        if "ms" in r:
            k = (r["kernel"], r["d"], r["precision"])
            if k not in best or r["ms"] < best[k]["ms"]:
                best[k] = r
    for k, r in sorted(best.items()):
        print("BEST", k, r)


if __name__ == "__main__":
    main()
