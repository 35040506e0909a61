"""Multiscale SamplesLoss on the GPU (issue 15): ours (loss + gradient, default multiscale options)
against flash-sinkhorn 0.4.1's multiscale mode (forward only: it has no gradients), and our own
untruncated solve converged to a tight tolerance at the same eps for the value.

    python3 bench/bench_multiscale.py [--sizes 65536,262144,1048576] [--big 4194304] [--data uniform|randn]
    python3 bench/bench_multiscale.py --hvp 65536,262144     # the HVP rows only
    python3 bench/bench_multiscale.py --sizes 262144 --big 0 --no-flash --tight-max 262144 --json-suffix _tight  # tol=1e-4 rows
    python3 bench/bench_multiscale.py --ott 65536            # sinkhorn(..., multiscale=...) vs the dense solver

Workload: ``uniform``: x, y ~ U[0, 1]^3 (flash-sinkhorn's README example, where its 363 ms at
2^20 was measured); ``randn``: x ~ N(0, I_3), y ~ N(0.5, I_3). Fixed CPU seeds, uniform weights,
blur 0.05, scaling 0.5, debias. Per size: median ms over repetitions after a warm-up (CUDA
events), the first call's wall time, peak memory, the solve's report (clusters, kept fraction,
sweeps on the points, finishing steps, marginal error, dropped-mass bound), the time of one
block-sparse LSE pass on the final x-y ranges and the fraction of the columns it streams, and
(n <= 2^18) the relative difference of the value from the reference: our solve with every block
kept (truncate=None) and tol=1e-5. Writes bench/results/multiscale_<data>_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:  # torch_api without PYTHONPATH
    sys.path.append(os.path.dirname(HERE))
from common import cuda_median_ms, environment  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core import launch_plans  # noqa: E402
from torch_api import kernel_ops  # noqa: E402

BLUR, SCALING, REPS = 0.05, 0.5, 5
REF_TOL = 1e-5


def clouds(n: int, data: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    if data == "uniform":
        return torch.rand(n, 3, generator=g).cuda(), torch.rand(n, 3, generator=g).cuda()
    return torch.randn(n, 3, generator=g).cuda(), (torch.randn(n, 3, generator=g) + 0.5).cuda()


def cuda_ms(fn, reps: int = REPS) -> list[float]:
    return cuda_median_ms(fn, reps=reps, warmup=0)[1]


def one_pass(res) -> dict:
    """One block-sparse LSE pass over the last extrapolation's x-y ranges: its time and the
    fraction of the n x m pairs it streams."""
    new, plans, prm, _, _ = res.state
    X, Y, g, lb, ranges = plans["xy"]
    try:
        rng = None if ranges is None else ranges()
    except RuntimeError:  # not built: the plan took the Taylor pass (multiscale_solve._Ranges)
        rng = None
    if rng is None:
        return {}
    f = lambda: kernel_ops.lse_blocksparse(X, Y, g, prm, rng, "float32", logw_in=lb)  # noqa: E731
    f()
    ms = statistics.median(cuda_ms(f, 10))
    bm = launch_plans.blocksparse_block_m(3, "float32", True)
    streamed = float((rng[..., 1] - rng[..., 0]).clamp_min(0).double().sum()) * bm / (X.n * Y.n)
    return {"lse_pass_ms": ms, "streamed_fraction": streamed}


def solve_report(res) -> dict:
    return {"kept": res.kept, "clusters": list(res.clusters), "jump": res.jump, "schedule_len": len(res.eps),
            "sweeps": res.sweeps, "finish_sweeps": res.finish_sweeps, "coarse_finish_sweeps": res.coarse_finish_sweeps,
            "taylor_passes": res.taylor_passes, "marginal_error": res.marginal_error,
            "converged": res.converged, "dropped_mass_bound": res.dropped_mass_bound}


def ours(x: torch.Tensor, y: torch.Tensor, reps: int = REPS, **options) -> dict:
    loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale", **options)

    def call():
        xg = x.detach().requires_grad_(True)
        value = loss(xg, y)
        (g,) = torch.autograd.grad(value, xg)
        return value, g

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    value, g = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times = cuda_ms(call, reps if first < 20 else 1)
    value, g = call()
    res = loss.last_multiscale
    return {"options": options, "ms": statistics.median(times), "times_ms": times, "first_call_s": first,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20, "value": float(value.detach()),
            "grad_finite": bool(torch.isfinite(g).all()), **solve_report(res), **one_pass(res)}


def reference_value(x: torch.Tensor, y: torch.Tensor) -> dict:
    loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale", truncate=None,
                                 tol=REF_TOL)
    t0 = time.perf_counter()
    value = float(loss(x, y))
    torch.cuda.synchronize()
    return {"value": value, "wall_s": time.perf_counter() - t0, "truncate": None, "tol": REF_TOL,
            **solve_report(loss.last_multiscale)}


def flash(x: torch.Tensor, y: torch.Tensor) -> dict:
    try:
        from flash_sinkhorn.samples_loss import SamplesLoss as FlashLoss
        loss = FlashLoss("sinkhorn", p=2, blur=BLUR, scaling=SCALING, debias=True, half_cost=True,
                         backend="multiscale")  # tol: its default, 5e-3 (ours: the same default)
        t0 = time.perf_counter()
        loss(x, y)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        times = cuda_ms(lambda: loss(x, y))
        info = loss.last_multiscale_info
        return {"ms": statistics.median(times), "times_ms": times, "first_call_s": first,
                "value": float(loss(x, y)), "accepted": getattr(info, "accepted", None),
                "stop": getattr(info, "stop", None), "fine_updates": getattr(info, "fine_updates", None), "call": "flash_sinkhorn.samples_loss.SamplesLoss('sinkhorn', p=2, "
                f"blur={BLUR}, scaling={SCALING}, debias=True, half_cost=True, backend='multiscale') (forward only)"}
    except Exception as exc:  # absent or failing: the row says so
        return {"ms": None, "failure": repr(exc)[:400]}


def jax_twin(x: torch.Tensor, y: torch.Tensor) -> dict:
    """ot_triton_jax.samples_loss(backend="multiscale"): jax.value_and_grad, eager (the twin runs
    torch_api's solve on the same device memory); wall-clock medians with block_until_ready."""
    try:
        import jax
        import ot_triton_jax as otj
        from ot_triton_jax import from_torch
        xj, yj = from_torch(x.contiguous()), from_torch(y.contiguous())
        f = jax.value_and_grad(lambda z: otj.samples_loss(z, yj, blur=BLUR, scaling=SCALING, backend="multiscale"))
        t0 = time.perf_counter()
        jax.block_until_ready(f(xj))
        first = time.perf_counter() - t0
        times = []
        for _ in range(REPS):
            t0 = time.perf_counter()
            value, g = jax.block_until_ready(f(xj))
            times.append(1e3 * (time.perf_counter() - t0))
        return {"ms": statistics.median(times), "times_ms": times, "first_call_s": first, "value": float(value),
                "grad_finite": bool(jax.numpy.isfinite(g).all()),
                "call": "jax.value_and_grad(ot_triton_jax.samples_loss(backend='multiscale')), eager, wall clock"}
    except Exception as exc:  # absent or failing: the row says so
        return {"ms": None, "failure": repr(exc)[:400]}


def hvp_row(n: int, data: str) -> dict:
    """The multiscale HVP in x (default options) against the dense HVP at the same potentials
    (samples_loss_ops.hvp: every pair kept) and against the dense backend's own HVP (its own
    solve): times (CUDA events, one call each for the dense ones) and relative differences."""
    from torch_api import samples_loss_ops
    from torch_api.multiscale_hvp import multiscale_hvp
    x, y = clouds(n, data)
    a = torch.full((n,), 1.0 / n, device="cuda")
    v = torch.randn(n, 3, generator=torch.Generator().manual_seed(1)).cuda()
    loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")
    xg = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(loss(xg, y), xg, create_graph=True)
    (h,) = torch.autograd.grad((gx * v).sum(), xg)  # the double backward (warm-up: compiles)
    res = loss.last_multiscale
    times = cuda_ms(lambda: multiscale_hvp(res, v, None, True, "float32"), 3)
    mine = multiscale_hvp(res, v, None, True, "float32")[0]
    eps = torch.tensor(res.eps[-1], device="cuda")
    pots = [p[None] for p in res.new]
    t_dense = cuda_ms(lambda: samples_loss_ops.hvp(x, y, a, a, *pots, eps, v, None, True, "float32"), 1)
    same = samples_loss_ops.hvp(x, y, a, a, *pots, eps, v, None, True, "float32")[0]
    rel = lambda u, r: float((u.double() - r.double()).norm() / r.double().norm())  # noqa: E731
    dense_loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING)
    xd = x.clone().requires_grad_(True)
    t0 = time.perf_counter()
    (gd,) = torch.autograd.grad(dense_loss(xd, y), xd, create_graph=True)
    (hd,) = torch.autograd.grad((gd * v).sum(), xd)
    torch.cuda.synchronize()
    return {"n": n, "m": n, "d": 3, "data": data, "blur": BLUR, "scaling": SCALING, "clusters": list(res.clusters),
            "kept": res.kept, "dropped_mass_bound": res.dropped_mass_bound,
            "multiscale_hvp_ms": statistics.median(times), "multiscale_hvp_times_ms": times,
            "double_backward_equals_hvp_rel": rel(h, mine), "dense_hvp_same_potentials_ms": t_dense[0],
            "rel_diff_vs_dense_hvp_same_potentials": rel(mine, same),
            "dense_backend_solve_and_hvp_s": time.perf_counter() - t0,
            "rel_diff_vs_dense_backend_hvp": rel(mine, hd), "finite": bool(torch.isfinite(mine).all())}


def ott_row(n: int, data: str) -> dict:
    """The OTT-convention option, torch_api.sinkhorn(x, y, epsilon=blur^2, scale_cost=2 (GeomLoss's
    |x - y|^2 / 2), threshold=5e-3, multiscale=MultiscaleOptions()): reg_ot_cost + gradient in x
    (medians, CUDA events), against the dense solver on the same problem (one call, converged to the
    same threshold from zero potentials): times and the relative difference of the costs."""
    x, y = clouds(n, data)
    kw = dict(epsilon=BLUR ** 2, scale_cost=2.0, threshold=5e-3)

    def call(**extra):
        xg = x.detach().requires_grad_(True)
        out = torch_api.sinkhorn(xg, y, **kw, **extra)
        (g,) = torch.autograd.grad(out.reg_ot_cost, xg)
        return out, g

    opts = torch_api.MultiscaleOptions()
    call(multiscale=opts)
    times = cuda_ms(lambda: call(multiscale=opts))
    out, g = call(multiscale=opts)
    t0 = time.perf_counter()
    dense, gd = call(max_iterations=100000)
    torch.cuda.synchronize()
    dense_s = time.perf_counter() - t0
    rel = lambda u, r: float((u.double() - r.double()).norm() / r.double().norm())  # noqa: E731
    return {"n": n, "m": n, "d": 3, "data": data, "epsilon": kw["epsilon"], "threshold": kw["threshold"],
            "multiscale_ms": statistics.median(times), "multiscale_times_ms": times,
            "converged": bool(out.converged), "marginal_error": out.marginal_error,
            "dropped_mass_bound": out.dropped_mass_bound, "clusters": list(out.report.clusters),
            "dense_first_call_s": dense_s, "dense_converged": bool(dense.converged), "dense_n_iters": int(dense.n_iters),
            "cost_rel_diff_vs_dense": abs(float(out.reg_ot_cost) - float(dense.reg_ot_cost)) / abs(float(dense.reg_ot_cost)),
            "grad_x_rel_diff_vs_dense": rel(g, gd)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="65536,262144,1048576")
    ap.add_argument("--big", type=int, default=1 << 22, help="one run at this size (0: none)")
    ap.add_argument("--data", default="uniform", choices=["uniform", "randn"])
    ap.add_argument("--no-flash", action="store_true")
    ap.add_argument("--no-reference", action="store_true", help="skip the untruncated float32 reference solve")
    ap.add_argument("--cluster-scales", default="", help="extra rows with these cluster_scale values "
                    "(non-default settings, reported beside the default)")
    ap.add_argument("--profile", type=int, default=0, help="print a torch.profiler table of one call at this size")
    ap.add_argument("--profile-cluster-scale", type=float, default=None)
    ap.add_argument("--jax", action="store_true", help="also time the JAX twin (jax.value_and_grad, eager)")
    ap.add_argument("--tight-max", type=int, default=1 << 16, help="rows with tol=1e-4 up to this size")
    ap.add_argument("--json-suffix", default="", help="write multiscale_<data><suffix>_<device>.json instead")
    ap.add_argument("--ott", default="", help="only the OTT-convention option's rows at these sizes "
                    "(multiscale_ott_<data>_<device>.json)")
    ap.add_argument("--hvp", default="", help="only the HVP rows at these sizes (multiscale_hvp_<data>_<device>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_multiscale.py needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name().lower().replace(" ", "-")
    for kind, sizes, row in (("hvp", args.hvp, hvp_row), ("ott", args.ott, ott_row)):
        if sizes:  # only these rows, at these sizes
            rows = []
            path = os.path.join(HERE, "results", f"multiscale_{kind}_{args.data}_{dev}.json")
            for n in [int(v) for v in sizes.split(",") if v]:
                rows.append(row(n, args.data))
                print(json.dumps(rows[-1]), flush=True)
                with open(path, "w") as fh:
                    json.dump({"env": environment(), "rows": rows}, fh, indent=1)
            print("wrote", path)
            return 0
    if args.profile:
        x, y = clouds(args.profile, args.data)
        loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale",
                                     cluster_scale=args.profile_cluster_scale)
        xg = x.clone().requires_grad_(True)  # loss + gradient: the call the rows time
        torch.autograd.grad(loss(xg, y), xg)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.autograd.grad(loss(xg, y), xg)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=40), flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=40), flush=True)
        print(json.dumps(solve_report(loss.last_multiscale)), flush=True)
    rows = []
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"multiscale_{args.data}{args.json_suffix}_{dev}.json")
    for n in [int(s) for s in args.sizes.split(",") if s] + ([args.big] if args.big else []):
        x, y = clouds(n, args.data)
        row = {"n": n, "m": n, "d": 3, "data": args.data, "blur": BLUR, "scaling": SCALING, "ours": ours(x, y)}
        if n <= args.tight_max:  # a tighter tolerance beside the default (non-default setting)
            row["ours_tol_1e-4"] = ours(x, y, reps=3, tol=1e-4)
        if args.jax:
            row["ours_jax"] = jax_twin(x, y)
        for cs in [float(c) for c in args.cluster_scales.split(",") if c]:
            row[f"ours_cluster_scale_{cs:g}"] = ours(x, y, reps=3, cluster_scale=cs)
        if n != args.big and not args.no_flash:
            row["flash_multiscale"] = flash(x, y)
            fm = row["flash_multiscale"].get("ms")
            row["speedup_vs_flash_forward"] = fm / row["ours"]["ms"] if fm else None
        if n <= 1 << 18 and not args.no_reference:
            ref = reference_value(x, y)
            row["reference"] = ref
            for key in [k for k in row if k.startswith("ours")] + ["flash_multiscale"]:
                if isinstance(row.get(key), dict) and row[key].get("value") is not None:
                    row[key]["value_rel_diff_vs_reference"] = abs(row[key]["value"] - ref["value"]) / abs(ref["value"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as fh:  # after every size: a later timeout keeps what was measured
            json.dump({"env": environment(), "rows": rows}, fh, indent=1)
        torch.cuda.empty_cache()
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
