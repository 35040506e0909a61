"""python -m parity [--n N] [--d D] [--eps EPS]: solve one problem with every frontend and report."""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import torch_api


def _jax_row(jax, solve, x, y):
    """Jit, warm up and time one JAX solver; its (cost, last error, iters, converged, seconds, f)."""
    solve = jax.jit(solve)
    jax.block_until_ready(solve(x, y))
    t = time.perf_counter()
    res = jax.block_until_ready(solve(x, y))
    errs = np.asarray(res.errors)
    return (float(res.reg_ot_cost), float(errs[errs >= 0][-1]), int(res.n_iters), bool(res.converged),
            time.perf_counter() - t, np.asarray(res.f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=None, help="points per cloud (default 4096 on GPU, 64 on CPU)")
    ap.add_argument("--d", type=int, default=3)
    ap.add_argument("--eps", type=float, default=None, help="epsilon (default 0.1 on GPU, 0.5 on CPU)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.n or (4096 if dev == "cuda" else 64)
    args.eps = args.eps or (0.1 if dev == "cuda" else 0.5)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((n, args.d)).astype(np.float32)
    y_np = (rng.standard_normal((n, args.d)) * 0.8 + 0.5).astype(np.float32)
    kw = dict(epsilon=args.eps, threshold=1e-4, max_iterations=2000)
    print(f"problem: n = m = {n}, d = {args.d}, eps = {args.eps}, device = {dev}"
          f"{'' if dev == 'cuda' else ' (Triton interpreter: slow, small n)'}")
    print(f"{'solver':<26}{'reg_ot_cost':>14}{'marg. err':>11}{'iters':>7}{'conv.':>7}{'time s':>9}")
    rows = {}
    x, y = torch.from_numpy(x_np).to(dev), torch.from_numpy(y_np).to(dev)
    torch_api.sinkhorn(x, y, **kw)  # compile / warm up
    t = time.perf_counter()
    out = torch_api.sinkhorn(x, y, **kw)
    rows["torch_api.sinkhorn"] = (float(out.reg_ot_cost), float(out.errors[out.errors >= 0][-1]), int(out.n_iters),
                                  bool(out.converged), time.perf_counter() - t, out.f.cpu().numpy())
    try:
        import jax

        import ot_triton_jax
        rows["ot_triton_jax.sinkhorn"] = _jax_row(jax, lambda x, y: ot_triton_jax.sinkhorn(x, y, **kw), x_np, y_np)
        from ott.geometry import pointcloud
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn as ott_sinkhorn

        def ott_solve(x, y):
            return ott_sinkhorn.Sinkhorn(**{k: v for k, v in kw.items() if k != "epsilon"})(
                linear_problem.LinearProblem(pointcloud.PointCloud(x, y, epsilon=args.eps)))

        rows["OTT-JAX 0.6 (dense)"] = _jax_row(jax, ott_solve, x_np, y_np)
    except ImportError as exc:
        print(f"(JAX frontend or OTT-JAX skipped: {exc})")
    for name, (cost, err, it, conv, sec, _) in rows.items():
        print(f"{name:<26}{cost:>14.7f}{err:>11.2e}{it:>7d}{str(conv):>7}{sec:>9.3f}")
    ref = rows.get("OTT-JAX 0.6 (dense)")
    if ref is not None:
        print("relative difference to OTT-JAX:")
        for name, (cost, _, _, _, _, f) in rows.items():
            if name.startswith("OTT"):
                continue
            df = np.linalg.norm(f - ref[5]) / np.linalg.norm(ref[5])
            print(f"  {name:<24} cost {abs(cost - ref[0]) / abs(ref[0]):.1e}   f {df:.1e}")


if __name__ == "__main__":
    main()
