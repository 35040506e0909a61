"""Why the block-sparse apply pass (P y and P 1, the fused last sweep) costs ~1.45x the LSE pass
at 2^20 (bench/NOTES.md 59): the same masks and potentials as sweep_blocksparse.py, timed with
the product with V on CUDA-core FMAs (the default for p <= launch_plans.FMA_MAX_P: one row
reduction per column of V) against tl.dot with 3xTF32 (BLOCK_P 16), and the row sums alone.
Outputs are compared with the default's (relative). Writes bench/results/probe_apply_variants_<device>.json.

    python3 bench/probe_apply_variants.py [--n 1048576]
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
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
    fma_max = launch_plans.FMA_MAX_P
    for name, fma, v in (("apply_fma", fma_max, Y.x), ("apply_dot_tf32x3", 0, Y.x), ("rowsum_only", fma_max, None)):
        launch_plans.FMA_MAX_P = fma
        _clear()
        app = lambda: kernel_ops.apply_plan_blocksparse(X, Y, f_new, g_app, prm, rng, "float32", v)  # noqa: E731
        pv, rs = app()
        row = {"ms": statistics.median(cuda_median_ms(app, reps=7)[1]), "finite": bool(torch.isfinite(rs).all())}
        if ref is None:
            ref = (pv, rs)
        if pv is not None:
            row["pv_rel_diff_vs_fma"] = float((pv - ref[0]).norm() / ref[0].norm())
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
