"""jax.vmap of ot_triton_jax.sinkhorn over a batch of problems vs a Python loop of single solves.

Issue #12 item 4: a vmapped streaming solve runs the kernels as a loop over the batch
(``custom_vmap`` rules with ``lax.map``, ``jax_frontend/batching.py``). This measures
what that costs against the obvious alternative, a Python loop of single jitted solves on
the same inputs:

  * vmap: ``jax.jit(jax.vmap(lambda x, y: (out.reg_ot_cost, out.f, out.n_iters)))`` on
    (B, n, d) and (B, m, d) clouds, one call;
  * loop: ``jax.jit`` of the same single solve, called B times from Python on the
    pre-sliced problems, then one block on all results;
  * lax_map (for reference): ``jax.jit(lambda x, y: jax.lax.map(solve, (x, y)))``, the
    loop over whole solves inside one jitted program: each problem runs its own
    stopping loop (what a solve-level batching rule would give).

Workloads: B = 8 problems at n = m = 4096, d = 64, eps = 0.1 (Gaussian clouds with
coordinate scales exp(-j/4), problem k scaled by linspace(0.5, 1.5)[k] so that their
iteration counts differ), uniform weights,

  * "fixed": 100 iterations (min_iterations = max_iterations = 100, inner_iterations = 10);
  * "early_stopping": the defaults (threshold 1e-3, inner_iterations 10, max_iterations
    2000). Batched launch by launch, the solver's ``while_loop`` gets a batched stopping
    test: it runs until the slowest problem stops and computes every problem (the
    stopped ones frozen) in every iteration, B * max(n_iters) iterations' worth of
    launches, where the loop and lax_map run sum(n_iters).

Reported per workload: median wall times (ms, after a compiling warm-up call) of each,
``vmap_over_loop`` = vmap / loop (below 1: the vmap is faster), the median of
side-by-side pair ratios, each problem's n_iters, and the max differences between the two
(reg_ot_cost relative, f absolute and relative to max |f|; n_iters must be equal).

    python bench/bench_jax_vmap.py [OUT_DIR] [--small] [--backend triton_call|callback|auto]

OUT_DIR defaults to bench/results/; the JSON is jax_vmap[_small]_<device>.json.
``--small`` (n = m = 16, d = 2, B = 2, few iterations) runs anywhere, the CPU included
(Triton interpreter, callback backend): a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, device_tag, environment, wall_median_ms  # noqa: E402

import torch_api  # noqa: E402,F401  (configures GPU vs interpreter before any kernel import)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ot_triton_jax as otj  # noqa: E402
from ot_triton_jax.jax_frontend.launch import resolve_backend  # noqa: E402

EPS = 0.1
FULL = dict(batch=8, n=4096, m=4096, d=64, fixed_iters=100, early=dict(), reps=10, pairs=10)
SMALL = dict(batch=2, n=16, m=16, d=2, fixed_iters=5, early=dict(threshold=1e-2, inner_iterations=2,
                                                                 max_iterations=30), reps=2, pairs=2)


def clouds(batch, n, m, d, seed=0):
    """Gaussian clouds with coordinate scales exp(-j / 4) (a few effective dimensions, so the
    plans have structure) and problem k scaled by linspace(0.5, 1.5)[k] (its iteration count
    grows with the scale: the early-stopping problems differ)."""
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    decay = jnp.exp(-jnp.arange(d, dtype=jnp.float32) / 4.0)
    scale = jnp.linspace(0.5, 1.5, batch, dtype=jnp.float32)[:, None, None]
    x = jax.random.normal(kx, (batch, n, d), jnp.float32) * decay * scale
    y = (jax.random.normal(ky, (batch, m, d), jnp.float32) * decay + 0.1) * scale
    return x, y


def compare(vm, lp) -> dict:
    """Max differences between the vmapped results and the loop's (cost, f, n_iters)."""
    cost_v, f_v, it_v = (np.asarray(v, np.float64) for v in vm)
    cost_l, f_l, it_l = (np.asarray(v, np.float64) for v in lp)
    bad = bool(np.isnan(cost_v).any() or np.isnan(f_v).any())
    df = np.abs(f_v - f_l)
    return {
        "max_err_cost_rel": float(np.max(np.abs(cost_v - cost_l) / np.abs(cost_l))),
        "max_err_f_abs": float(df.max()),
        "max_err_f_rel_to_max": float(df.max() / np.abs(f_l).max()),
        "n_iters_equal": bool(np.array_equal(it_v, it_l)),
        "nan_in_vmap": bad,
        "n_iters": it_v.astype(int).tolist(),
        "reg_ot_cost": cost_v.tolist(),
    }


def workload(name: str, sizes: dict, kw: dict, backend: str | None) -> dict:
    B, n, m, d = sizes["batch"], sizes["n"], sizes["m"], sizes["d"]
    x, y = clouds(B, n, m, d)

    def solve(x, y):
        out = otj.sinkhorn(x, y, epsilon=EPS, backend=backend, **kw)
        return out.reg_ot_cost, out.f, out.n_iters

    vmapped = jax.jit(jax.vmap(solve))
    single = jax.jit(solve)
    mapped = jax.jit(lambda x, y: jax.lax.map(lambda p: solve(*p), (x, y)))
    xs, ys = [x[k] for k in range(B)], [y[k] for k in range(B)]  # sliced once, outside the timing
    jax.block_until_ready((xs, ys))
    box = {}

    def run_vmap():
        box["vmap"] = jax.block_until_ready(vmapped(x, y))

    def run_loop():
        box["loop"] = jax.block_until_ready([single(xk, yk) for xk, yk in zip(xs, ys)])

    def run_map():
        box["lax_map"] = jax.block_until_ready(mapped(x, y))

    rec = {"workload": name, "batch": B, "n": n, "m": m, "d": d, "eps": EPS, "solve_kwargs": kw}
    rec["vmap_ms"], rec["vmap_times_ms"] = wall_median_ms(run_vmap, reps=sizes["reps"])
    rec["loop_ms"], rec["loop_times_ms"] = wall_median_ms(run_loop, reps=sizes["reps"])
    rec["lax_map_ms"], rec["lax_map_times_ms"] = wall_median_ms(run_map, reps=sizes["reps"])
    rec["lax_map_over_loop"] = rec["lax_map_ms"] / rec["loop_ms"]

    pairs = []  # side by side: a drift of the host or the clocks moves both
    for _ in range(sizes["pairs"]):
        t_v, _ = wall_median_ms(run_vmap, reps=1, warmup=0)
        t_l, _ = wall_median_ms(run_loop, reps=1, warmup=0)
        pairs.append(t_v / t_l)
    rec["vmap_over_loop"] = rec["vmap_ms"] / rec["loop_ms"]
    rec["vmap_over_loop_pairs_median"] = statistics.median(pairs)
    rec["vmap_over_loop_pairs"] = pairs
    loop_stacked = tuple(jnp.stack(v) for v in zip(*box["loop"]))
    rec.update(compare(box["vmap"], loop_stacked))
    rec["lax_map_vs_loop"] = {k: v for k, v in compare(box["lax_map"], loop_stacked).items()
                              if k.startswith(("max_err", "n_iters_equal"))}
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default=RESULTS, help="directory for the JSON (default bench/results/)")
    ap.add_argument("--small", action="store_true", help="n = m = 16, d = 2, B = 2: runs on the CPU")
    ap.add_argument("--backend", default=None, help="kernel launcher: triton_call, callback or auto (default)")
    args = ap.parse_args()
    if not args.small and jax.default_backend() != "gpu":
        print("bench_jax_vmap: JAX has no GPU backend here; use --small for a CPU smoke run")
        return
    sizes = SMALL if args.small else FULL
    backend = None if args.backend in (None, "auto") else args.backend
    runs = {"fixed": dict(min_iterations=sizes["fixed_iters"], max_iterations=sizes["fixed_iters"],
                          inner_iterations=10 if not args.small else 5),
            "early_stopping": dict(sizes["early"])}
    results = []
    for name, kw in runs.items():
        t0 = time.perf_counter()
        try:
            rec = workload(name, sizes, kw, backend)
        except Exception as exc:  # recorded, not hidden
            rec = {"workload": name, "error": repr(exc)[:600]}
        rec["wall_s"] = time.perf_counter() - t0
        print({k: v for k, v in rec.items() if not k.endswith(("times_ms", "pairs"))}, flush=True)
        results.append(rec)
    env = environment()
    env["jax_backend"] = jax.default_backend()
    env["jax_devices"] = [str(dv) for dv in jax.devices()]
    env["kernel_launcher"] = resolve_backend(backend)
    note = ("jitted jax.vmap of sinkhorn(...) -> (reg_ot_cost, f, n_iters) over the batch vs a Python loop of "
            "the same jitted single solve on pre-sliced inputs (and vs a jitted lax.map over whole solves); "
            "wall-clock medians in ms after a compiling warm-up; vmap_over_loop < 1 means the vmap is faster; "
            "errors are vmap vs loop")
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"jax_vmap{'_small' if args.small else ''}_{device_tag()}.json")
    with open(path, "w") as fh:
        json.dump({"env": env, "results": results, "note": note}, fh, indent=1)
    print("wrote", path)
    for r in results:
        if "error" in r:
            print(f"{r['workload']}: ERROR {r['error']}")
            continue
        print(f"{r['workload']}: B={r['batch']} n={r['n']} d={r['d']}: vmap {r['vmap_ms']:.2f} ms, loop "
              f"{r['loop_ms']:.2f} ms, vmap/loop {r['vmap_over_loop']:.3f} "
              f"(pairs {r['vmap_over_loop_pairs_median']:.3f}), "
              f"lax_map of solves {r['lax_map_ms']:.2f} ms; "
              f"n_iters {r['n_iters']} (equal: {r['n_iters_equal']}); max err cost {r['max_err_cost_rel']:.1e}, "
              f"f {r['max_err_f_rel_to_max']:.1e}")


if __name__ == "__main__":
    main()
