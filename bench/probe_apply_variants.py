"""The block-sparse apply pass (P y and P 1, the fused last sweep) against the LSE pass at 2^20
(bench/NOTES.md 61, 85): the same masks and potentials as sweep_blocksparse.py, timed with the
product with the target points on CUDA-core FMAs (p <= launch_plans.FMA_MAX_P: one row reduction
per column), on the tensor cores from the packed FP16 parts (target_mean: P in FP16, and P as
FP16 hi + lo), optionally through tl.dot 3xTF32 (--tf32x3), and the row sums alone. Outputs are
compared with the FMA pass's: the softmin mean's largest deviation and its norm relative to the
gradient direction x - mean. Writes bench/results/probe_apply_variants_<device>.json.

    python3 bench/probe_apply_variants.py [--n 1048576] [--tf32x3]
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
from common import cuda_median_ms, environment  # noqa: E402

from ot_triton_jax.core import kernel_calls, launch_plans  # noqa: E402
from sweep_blocksparse import last_sweep  # noqa: E402
from torch_api import kernel_ops  # noqa: E402
from torch_api.multiscale_clusters import column_ranges, row_block_mask  # noqa: E402


def _clear() -> None:
    for cached in (launch_plans.lse_blocksparse_plan, launch_plans.apply_blocksparse_plan,
                   kernel_calls.lse_blocksparse, kernel_calls.apply_plan_blocksparse):
        cached.cache_clear()


def _float64_means(X, Y, f, g, prm, rng, block_m: int, count: int = 512) -> tuple:
    """(rows, their softmin means of the target points in float64) over the kept columns, for
    ``count`` rows drawn with a fixed seed."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, X.n, (count,), generator=gen).to(X.x.device)
    eps, s = float(prm[0]), float(prm[1])
    x, y, gd = X.x.double(), Y.x.double(), g.double()
    means = []
    for i in rows.tolist():
        cols = torch.cat([torch.arange(int(a), int(b), device=y.device) for a, b in rng[i // block_m].tolist() if b > a])
        z = (f.double()[i] + gd[cols] - s * ((x[i] - y[cols]) ** 2).sum(1)) / eps
        w = torch.softmax(z, 0)
        means.append(w @ y[cols])
    return rows, torch.stack(means)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--tf32x3", action="store_true", help="also time the product through tl.dot 3xTF32")
    args = ap.parse_args()
    X, Y, g_old, lb, f_new, prm, keep, lx, start_y = last_sweep(args.n)
    bm = launch_plans.GPU_BLOCKSPARSE["k16"]["BLOCK_M"]
    rng = column_ranges(row_block_mask(keep, lx, bm), start_y)
    g_app = g_old + prm[0] * lb
    rows, ref = {}, None
    lse = lambda: kernel_ops.lse_blocksparse(X, Y, g_old, prm, rng, "float32", logw_in=lb,  # noqa: E731
                                             pold=f_new, compute_err=True, fold=True)
    lse()
    rows["lse_fold"] = {"ms": statistics.median(cuda_median_ms(lse, reps=7)[1])}
    # (name, FMA_MAX_P, V, target_mean); the first is the float32 FMA pass
    variants = (("apply_fma", launch_plans.FMA_MAX_P, Y.x, False),
                ("mean_fp16", launch_plans.FMA_MAX_P, None, True),
                ("rowsum_only", launch_plans.FMA_MAX_P, None, False))
    if args.tf32x3:
        variants += (("apply_dot_tf32x3", 0, Y.x, False),)
    ref64 = _float64_means(X, Y, f_new, g_app, prm, rng, bm)
    fma_max = launch_plans.FMA_MAX_P
    for name, fma, v, tm in variants:
        launch_plans.FMA_MAX_P = fma
        _clear()
        app = lambda: kernel_ops.apply_plan_blocksparse(X, Y, f_new, g_app, prm, rng, "float32", v,  # noqa: E731
                                                        target_mean=tm)
        pv, rs = app()
        row = {"ms": statistics.median(cuda_median_ms(app, reps=7)[1]), "finite": bool(torch.isfinite(rs).all())}
        if pv is not None:
            row["finite"] = row["finite"] and bool(torch.isfinite(pv).all())
        if ref is None:
            ref = (pv, rs)
        if pv is not None:
            mean, ref_mean = pv.double() / rs.double()[:, None], ref[0].double() / ref[1].double()[:, None]
            row["pv_rel_diff_vs_fma"] = float((pv - ref[0]).norm() / ref[0].norm())
            # the gradient's row direction x_i - mean_i (softmin mean of the target points)
            grad_ref = X.x.double() - ref_mean
            row["mean_max_abs_diff_vs_fma"] = float((mean - ref_mean).abs().max())
            row["grad_rel_diff_vs_fma"] = float((mean - ref_mean).norm() / grad_ref.norm())
            rows64, m64 = ref64
            g64 = X.x.double()[rows64] - m64
            row["float64_rows"] = int(rows64.numel())
            row["mean_max_abs_err_vs_float64"] = float((mean[rows64] - m64).abs().max())
            row["grad_rel_err_vs_float64"] = float((mean[rows64] - m64).norm() / g64.norm())
        row["rowsum_rel_diff_vs_fma"] = float((rs - ref[1]).norm() / ref[1].norm())
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    launch_plans.FMA_MAX_P = fma_max
    _clear()
    out = {"env": environment(), "n": args.n, "tiles": launch_plans.GPU_BLOCKSPARSE["k16"], "rows": rows}
    print(json.dumps(out, indent=1))
    dev = torch.cuda.get_device_name().lower().replace(" ", "-")
    with open(os.path.join(HERE, "results", f"probe_apply_variants_{dev}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
