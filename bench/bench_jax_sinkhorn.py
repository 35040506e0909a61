"""ot_triton_jax.sinkhorn (jitted) vs OTT-JAX dense and vs torch_api.sinkhorn, same process, same inputs.

Workloads (issue 3), randn clouds, uniform weights, eps = 0.1, fixed iterations
(min_iterations = max_iterations, inner_iterations = 10, so both solvers also measure the
marginal error every 10 iterations, as OTT does):

  A. n = m = 8192, d = 64, 100 iterations: ours (triton_call and callback backends) against
     OTT-JAX 0.6.0 ``PointCloud`` dense (``jax.default_matmul_precision("highest")``), both
     under ``jax.jit``. Accuracy of f, g and reg_ot_cost against a float64 run of the same
     100 iterations (chunked dense float64 on the GPU): f and g on 512 sampled rows, also
     after removing the constant shift (f + c, g - c) that Sinkhorn leaves free.
  B. n = m = 65536, d = 64, 10 iterations: ours (jitted, both backends) against
     torch_api.sinkhorn on the same arrays (DLPack, no copy); accuracy of f on 512 rows
     against float64.

Times: medians of wall time around a call that blocks on its result (after one warm-up
call that compiles), in ms. Writes bench/results/jax_sinkhorn_<device>.json.

    python bench/bench_jax_sinkhorn.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, f64_sinkhorn, wall_median_ms, write  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ot_triton_jax as otj  # noqa: E402
import torch_api  # noqa: E402

EPS = 0.1


def to_t(a) -> torch.Tensor:
    return otj.to_torch(a) if isinstance(a, jax.Array) else a


def errors(f, g, cost, ref, rows) -> dict:
    f, g = to_t(f).double(), to_t(g).double()
    fr, gr, cr = ref
    shift = float((f - fr).mean())  # the free constant of (f + c, g - c)
    rel = lambda u, v: float((u[rows] - v[rows]).norm() / v[rows].norm())  # noqa: E731
    return {"err_f": rel(f, fr), "err_g": rel(g, gr), "err_f_shift_removed": rel(f - shift, fr),
            "err_g_shift_removed": rel(g + shift, gr), "err_cost": abs(float(cost) - cr) / abs(cr)}


def ours_fn(iters, backend, precision="float32"):
    kw = dict(epsilon=EPS, min_iterations=iters, max_iterations=iters, inner_iterations=10,
              precision=precision, backend=backend)
    return jax.jit(lambda x, y: otj.sinkhorn(x, y, **kw))


def workload_a(quick: bool) -> dict:
    n, d, iters = (8192, 64, 100) if not quick else (4096, 64, 20)
    key = jax.random.PRNGKey(0)
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (n, d), jnp.float32)
    y = jax.random.normal(ky, (n, d), jnp.float32)
    ref = f64_sinkhorn(to_t(x), to_t(y), iters, EPS)
    torch.manual_seed(0)
    rows = torch.randperm(n, device="cuda")[:512]
    rec = {"workload": "A", "n": n, "m": n, "d": d, "eps": EPS, "iters": iters, "inner_iterations": 10}

    runs = {}
    for backend in ("triton_call", "callback"):
        fn = ours_fn(iters, backend)
        box = {}

        def run(fn=fn, box=box):
            box["out"] = jax.block_until_ready(fn(x, y))
        runs[backend] = run

        try:
            t, ts = wall_median_ms(run, reps=15)
        except Exception as exc:  # recorded, not hidden
            rec[f"ours_{backend}_error"] = repr(exc)[:400]
            continue
        out = box["out"]
        rec[f"ours_{backend}_ms"] = t
        rec[f"ours_{backend}_times_ms"] = ts
        rec[f"ours_{backend}_n_iters"] = int(out.n_iters)
        for k, v in errors(out.f, out.g, out.reg_ot_cost, ref, rows).items():
            rec[f"ours_{backend}_{k}"] = v

    try:
        from ott.geometry import pointcloud
        from ott.solvers.linear import sinkhorn as ott_sinkhorn
        from ott.problems.linear import linear_problem

        with jax.default_matmul_precision("highest"):
            solver = ott_sinkhorn.Sinkhorn(min_iterations=iters, max_iterations=iters, inner_iterations=10)

            @jax.jit
            def ott_solve(x, y):
                geom = pointcloud.PointCloud(x, y, epsilon=EPS)
                out = solver(linear_problem.LinearProblem(geom))
                return out.f, out.g, out.reg_ot_cost, out.n_iters

            box = {}

            def run_ott():
                box["out"] = jax.block_until_ready(ott_solve(x, y))

            t, ts = wall_median_ms(run_ott, reps=15)
            if "ours_triton_call_ms" in rec:
                # side by side: one call of each per pair, so that a drift of the host or the
                # clocks during the run moves both (the ratio is the median over pairs)
                runs["triton_call"]()  # compiled again under this matmul-precision setting
                pairs = []
                for _ in range(15):
                    t_ours, _ = wall_median_ms(runs["triton_call"], reps=1, warmup=0)
                    t_ott, _ = wall_median_ms(run_ott, reps=1, warmup=0)
                    pairs.append(t_ott / t_ours)
                rec["speedup_vs_ott_interleaved"] = statistics.median(pairs)
                rec["speedup_vs_ott_interleaved_pairs"] = pairs
        f, g, cost, n_it = box["out"]
        rec["ott_dense_highest_ms"] = t
        rec["ott_dense_highest_times_ms"] = ts
        rec["ott_dense_highest_n_iters"] = int(n_it)
        for k, v in errors(f, g, cost, ref, rows).items():
            rec[f"ott_dense_highest_{k}"] = v
        if "ours_triton_call_ms" in rec:
            rec["speedup_vs_ott"] = rec["ott_dense_highest_ms"] / rec["ours_triton_call_ms"]
    except Exception as exc:
        rec["ott_error"] = repr(exc)[:400]
    return rec


def workload_b(quick: bool) -> dict:
    n, d, iters = (65536, 64, 10) if not quick else (16384, 64, 10)
    torch.manual_seed(1)
    xt = torch.randn(n, d, device="cuda")
    yt = torch.randn(n, d, device="cuda")
    x, y = otj.from_torch(xt), otj.from_torch(yt)
    rows = torch.randperm(n, device="cuda")[:512]
    ref = f64_sinkhorn(xt, yt, iters, EPS)
    rec = {"workload": "B", "n": n, "m": n, "d": d, "eps": EPS, "iters": iters, "inner_iterations": 10}

    box = {}

    def run_torch():
        out = torch_api.sinkhorn(xt, yt, epsilon=EPS, min_iterations=iters, max_iterations=iters,
                                 inner_iterations=10)
        out.reg_ot_cost  # computed on first read: the same outputs as the JAX call (f, g, cost)
        torch.cuda.synchronize()
        box["torch"] = out

    t, ts = wall_median_ms(run_torch, reps=5)
    rec["torch_api_ms"], rec["torch_api_times_ms"] = t, ts
    out = box["torch"]
    for k, v in errors(out.f, out.g, out.reg_ot_cost.detach(), ref, rows).items():
        rec[f"torch_api_{k}"] = v

    for backend in ("triton_call", "callback"):
        fn = ours_fn(iters, backend)

        def run():
            box["jax"] = jax.block_until_ready(fn(x, y))

        try:
            t, ts = wall_median_ms(run, reps=5)
        except Exception as exc:
            rec[f"ours_{backend}_error"] = repr(exc)[:400]
            continue
        out = box["jax"]
        rec[f"ours_{backend}_ms"], rec[f"ours_{backend}_times_ms"] = t, ts
        for k, v in errors(out.f, out.g, out.reg_ot_cost, ref, rows).items():
            rec[f"ours_{backend}_{k}"] = v
        rec[f"ours_{backend}_over_torch"] = t / rec["torch_api_ms"]
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        print("bench_jax_sinkhorn: JAX has no GPU backend here; nothing to measure")
        return
    results = []
    for work in (workload_a, workload_b):
        t0 = time.perf_counter()
        rec = work(args.quick)
        rec["wall_s"] = time.perf_counter() - t0
        print({k: v for k, v in rec.items() if not k.endswith("times_ms")}, flush=True)
        results.append(rec)
        torch.cuda.empty_cache()
    env = environment()
    env["jax_backend"] = jax.default_backend()
    env["jax_devices"] = [str(dv) for dv in jax.devices()]
    env["OT_TRITON_JAX_BACKEND"] = os.environ.get("OT_TRITON_JAX_BACKEND")
    note = ("jitted solves, wall-clock medians after a compiling warm-up; errors vs float64 of the same "
            "fixed iterations on 512 sampled rows (f, g) and of reg_ot_cost")
    path = write("jax_sinkhorn" + ("_quick" if args.quick else ""),
                 {"env": env, "results": results, "note": note})
    print("wrote", path)
    a, b = results
    print(f"A n={a['n']} d={a['d']} {a['iters']} it: ours {a.get('ours_triton_call_ms', float('nan')):.1f} ms "
          f"(callback {a.get('ours_callback_ms', float('nan')):.1f}), OTT dense highest "
          f"{a.get('ott_dense_highest_ms', float('nan')):.1f} ms, speedup {a.get('speedup_vs_ott', float('nan')):.2f}x "
          f"(interleaved pairs {a.get('speedup_vs_ott_interleaved', float('nan')):.2f}x); "
          f"err_f ours {a.get('ours_triton_call_err_f', float('nan')):.1e} OTT {a.get('ott_dense_highest_err_f', float('nan')):.1e}")
    print(f"B n={b['n']} d={b['d']} {b['iters']} it: torch_api {b['torch_api_ms']:.1f} ms, ours "
          f"{b.get('ours_triton_call_ms', float('nan')):.1f} ms ({b.get('ours_triton_call_over_torch', float('nan')):.3f}x), "
          f"callback {b.get('ours_callback_ms', float('nan')):.1f} ms")


if __name__ == "__main__":
    main()
