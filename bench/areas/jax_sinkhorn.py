"""Jitted JAX Sinkhorn: ``ot_triton_jax.sinkhorn`` against OTT-JAX, against the PyTorch frontend, and under ``jax.vmap``.

Workloads (randn clouds, uniform weights, eps = 0.1, ``inner_iterations=10`` so that both solvers check
the marginal error every 10 iterations, as OTT does), in one process on the same inputs:

* ``jax_sinkhorn_100it``: n = m = 8192, d = 64 (CPU seed n + d), min = max = 100 iterations.
  ``ours``: the default call ``jax.jit(lambda x, y: ot_triton_jax.sinkhorn(x, y, epsilon=0.1,
  min_iterations=100, max_iterations=100))``; peers: OTT-JAX ``PointCloud`` dense and online
  (``batch_size`` 1024), jitted, matmul precision "highest". Floor: 201 half-steps (floors.py).
* ``jax_vs_torch_10it`` (not in ``--quick``): n = m = 65536, d = 64, 10 iterations: ours against
  ``torch_api.sinkhorn`` on the same device memory (``reg_ot_cost`` read too, as the JAX call returns it).
* ``jax_vmap`` (not in ``--quick``): B = 8 problems, n = m = 4096, d = 64 (JAX seed 0, coordinate scales
  exp(-j/4), problem k scaled by linspace(0.5, 1.5)[k] so that iteration counts differ), ``fixed``
  (100 iterations) and ``early_stopping`` (the defaults: threshold 1e-3, up to 2000 iterations).
  ``ours``: ``jax.jit(jax.vmap(solve))`` on (B, n, d) clouds; beside it a Python ``loop`` of the
  jitted single solve on pre-sliced problems and a jitted ``lax.map`` over whole solves.

Gate: f's relative error on 512 sampled rows against float64 of the same iterations
(references.f64_sinkhorn; for vmap the largest over the problems, each at its own n_iters), at most
1e-4. Times: wall-clock medians around calls that block on their result, after a compiling warm-up
call (15 repetitions at 8192, 5 at 65536, 10 for vmap).

    python -m bench.areas.jax_sinkhorn [--quick] [--dry-run] [--tiny]

Takes ~60 s on an H100 (``--quick`` ~20 s).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.floors import floor_ms, sinkhorn_half_steps  # noqa: E402
from bench.references import f64_sinkhorn, f_error, sample_rows  # noqa: E402

AREA, EPS, TOLERANCE = "jax", 0.1, 1e-4
ERROR_OF = "f on 512 sampled rows vs float64 of the same iterations"
SINGLE = "jax.jit(lambda x, y: ot_triton_jax.sinkhorn(x, y, epsilon=0.1, min_iterations={it}, max_iterations={it}))"
# (workload, sizes, expected seconds on the H100)
ITEMS = (("jax_sinkhorn_100it", dict(n=8192, d=64, iters=100), 20),
         ("jax_vs_torch_10it", dict(n=65536, d=64, iters=10), 20),
         ("jax_vmap", dict(batch=8, n=4096, d=64, iters=100), 25))
TINY = {"jax_sinkhorn_100it": dict(n=32, d=2, iters=10), "jax_vs_torch_10it": dict(n=32, d=2, iters=5),
        "jax_vmap": dict(batch=2, n=16, d=2, iters=5)}
VMAP_RUNS = {"fixed": "min_iterations={it}, max_iterations={it}, inner_iterations=10", "early_stopping": "defaults"}


def methods(workload: str) -> list[tuple[str, str]]:
    if workload == "jax_sinkhorn_100it":
        return [("ours", SINGLE), ("ott_dense_highest", "OTT dense, highest"), ("ott_online_highest", "OTT online, highest")]
    if workload == "jax_vs_torch_10it":
        return [("ours", SINGLE), ("torch_api", "torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations={it}, "
                                                "max_iterations={it}, inner_iterations=10); out.reg_ot_cost")]
    return [("ours", "jax.jit(jax.vmap(solve))(x, y)"), ("loop", "[jax.jit(solve)(x[k], y[k]) for k in range(B)]"),
            ("lax_map", "jax.jit(lambda x, y: jax.lax.map(solve, (x, y)))(x, y)")]


def rows_for(workload: str, sz: dict, results: dict, label_extra: str = "") -> list[dict]:
    rows, n, d, it = [], sz["n"], sz["d"], sz["iters"]
    label = (f"B={sz['batch']} " if "batch" in sz else "") + f"n={n} d={d}" + label_extra
    for method, call in methods(workload):
        extra = {}
        if workload == "jax_sinkhorn_100it":
            fl, unit = floor_ms(workload, n, n, d, "float32", sinkhorn_half_steps(it))
            res = results.get(method, {})
            extra = dict(floor_ms=fl, floor_unit=unit, fraction_of_floor=fl / res["ms"] if res.get("ms") else None)
        rows.append(harness.row(workload, label, dict(sz, m=n, eps=EPS), method, call.format(it=it),
                                results.get(method, {}), tolerance=TOLERANCE, error_of=ERROR_OF,
                                ours=method == "ours", default=method == "ours",
                                compare_to=None if method == "ours" else "ours", **extra))
    return rows


def single(sz: dict, workload: str, device: str) -> dict:
    import jax

    import ot_triton_jax as otj
    harness.after_jax_triton_import()
    n, d, it = sz["n"], sz["d"], sz["iters"]
    gen = torch.Generator().manual_seed(n + d)
    xt, yt = torch.randn(n, d, generator=gen).to(device), torch.randn(n, d, generator=gen).to(device)
    ref, rows = f64_sinkhorn(xt, yt, it, EPS)[0], sample_rows(n)
    check = lambda f, g: {"error": f_error(f, ref, rows)} if harness.finite(f, g) else {  # noqa: E731
        "failure": "non-finite output"}
    x, y = (otj.from_torch(t) if device == "cuda" else peers.to_jax(t) for t in (xt, yt))
    fn = jax.jit(lambda x, y: otj.sinkhorn(x, y, epsilon=EPS, min_iterations=it, max_iterations=it))
    reps = 15 if n <= 8192 else 5
    if device == "cpu":
        reps = 1
    out = {"ours": harness.measure(lambda: jax.block_until_ready(fn(x, y)), lambda o: check(o.f, o.g), reps, 1, "wall")}
    if workload == "jax_vs_torch_10it":
        import torch_api

        def torch_call():
            o = torch_api.sinkhorn(xt, yt, epsilon=EPS, min_iterations=it, max_iterations=it, inner_iterations=10)
            o.reg_ot_cost  # computed on first read: the same outputs as the JAX call
            return o
        out["torch_api"] = harness.measure(torch_call, lambda o: check(o.f, o.g), reps, 2, "wall")
        return out
    for online in (False, True):
        try:
            solve, _ = peers.ott_sinkhorn(it, EPS, online)
            with jax.default_matmul_precision("highest"):
                out[f"ott_{'online' if online else 'dense'}_highest"] = harness.measure(
                    lambda: jax.block_until_ready(solve(x, y)), lambda o: check(*o), reps, 2, "wall")
        except Exception as exc:
            out[f"ott_{'online' if online else 'dense'}_highest"] = harness.failed(exc)
    return out


def vmap_clouds(sz: dict):
    import jax
    import jax.numpy as jnp
    B, n, d = sz["batch"], sz["n"], sz["d"]
    kx, ky = jax.random.split(jax.random.PRNGKey(0))
    decay = jnp.exp(-jnp.arange(d, dtype=jnp.float32) / 4.0)
    scale = jnp.linspace(0.5, 1.5, B, dtype=jnp.float32)[:, None, None]
    x = jax.random.normal(kx, (B, n, d), jnp.float32) * decay * scale
    y = (jax.random.normal(ky, (B, n, d), jnp.float32) * decay + 0.1) * scale
    return x, y


def vmapped(sz: dict, run: str, device: str) -> dict:
    import jax
    import jax.numpy as jnp

    import ot_triton_jax as otj
    harness.after_jax_triton_import()
    it = sz["iters"]
    kw = dict(min_iterations=it, max_iterations=it, inner_iterations=10) if run == "fixed" else {}
    if device == "cpu":  # toy sizes: a loose threshold and few iterations
        kw = dict(kw, inner_iterations=2) if run == "fixed" else dict(threshold=1e-2, inner_iterations=2, max_iterations=30)

    def solve(x, y):
        o = otj.sinkhorn(x, y, epsilon=EPS, **kw)
        return o.f, o.g, o.n_iters

    x, y = vmap_clouds(sz)
    xs, ys = [x[k] for k in range(sz["batch"])], [y[k] for k in range(sz["batch"])]
    jax.block_until_ready((xs, ys))
    single_fn, vm, mapped = jax.jit(solve), jax.jit(jax.vmap(solve)), jax.jit(lambda x, y: jax.lax.map(lambda p: solve(*p), (x, y)))
    xt, yt = (peers.to_torch(a, device) for a in (x, y))
    rows = sample_rows(sz["n"])

    def check(out):
        f, g, n_iters = (np.asarray(v) for v in out)
        if not harness.finite(f, g):
            return {"failure": "non-finite output"}
        errs = [f_error(f[k], f64_sinkhorn(xt[k], yt[k], int(n_iters[k]), EPS)[0], rows) for k in range(len(f))]
        return {"error": max(errs), "n_iters": [int(v) for v in n_iters]}

    stack = lambda outs: tuple(jnp.stack(v) for v in zip(*outs))  # noqa: E731
    reps = 10 if device == "cuda" else 1
    return {"ours": harness.measure(lambda: jax.block_until_ready(vm(x, y)), check, reps, 1, "wall"),
            "loop": harness.measure(lambda: stack(jax.block_until_ready([single_fn(a, b) for a, b in zip(xs, ys)])),
                                    check, reps, 1, "wall"),
            "lax_map": harness.measure(lambda: jax.block_until_ready(mapped(x, y)), check, reps, 1, "wall")}


def measure(workload: str, sz: dict, device: str) -> list[dict]:
    if workload != "jax_vmap":
        return rows_for(workload, sz, single(sz, workload, device))
    rows = []
    for run in VMAP_RUNS:
        sz_run = dict(sz, solve=VMAP_RUNS[run].format(it=sz["iters"]))
        rows += rows_for(workload, sz_run, vmapped(sz, run, device), f" {run}")
    return rows


def plan(quick: bool) -> list[dict]:
    out = []
    for workload, sz, _ in ITEMS[: 1 if quick else None]:
        runs = [f" {r}" for r in VMAP_RUNS] if workload == "jax_vmap" else [""]
        out += [r for extra in runs for r in rows_for(workload, sz, {}, extra)]
    return harness.planned(out)


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    import jax
    if jax.default_backend() != "gpu":
        raise SystemExit("jax area: JAX has no GPU backend here")
    rows = []
    for workload, sz, est in ITEMS[: 1 if quick else None]:
        if not budget.fits(workload, est):
            continue
        try:
            rows += measure(workload, sz, "cuda")
        except Exception as exc:  # every planned row of the workload says so
            rows += [dict(r, failure=repr(exc)[:500], passed=False) for r in plan(False) if r["workload"] == workload]
        emit(rows)
        torch.cuda.empty_cache()
    return rows


def tiny() -> list[dict]:
    """Toy sizes on the CPU (callback backend, Triton interpreter): every code path, one repetition."""
    return [r for workload, _, _ in ITEMS for r in measure(workload, TINY[workload], "cpu")]


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
