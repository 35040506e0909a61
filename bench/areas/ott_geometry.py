"""OTT-JAX's own solvers on this library's geometry: ``ott_triton_jax.ott.PointCloud`` against OTT's
``PointCloud`` (dense, and online with ``batch_size``), the solver code unmodified.

Workloads (x ~ randn(n, d) / sqrt(d), y the same shifted by 0.3 / sqrt(d), uniform weights,
eps = 0.1), in one process on the same inputs, each geometry class dropped into the same call:

* ``ott_sinkhorn_default``: n = m = 8192, d in {3, 64}:
  ``jax.jit(lambda x, y: Sinkhorn()(LinearProblem(Geometry(x, y, epsilon=0.1))))`` with OTT's
  defaults (threshold 1e-3, checks every 10 iterations, implicit differentiation), converged.
* ``ott_sinkhorn_20it``: n = m = 65536, d in {3, 64}: ``Sinkhorn(min_iterations=20,
  max_iterations=20)``, the same call otherwise.
* ``ott_divergence_grad``: n = m = 8192, d = 64: an unmodified OTT training step,
  ``jax.jit(jax.grad(lambda x: sinkhorn_divergence(Geometry, x, y, epsilon=0.1)[0]))``.

Gate: for the solves, f's relative error on 512 sampled rows against float64 alternating
iterations (references.f64_sinkhorn) of the solve's own iteration count, at most 1e-4; for the
training step the gradient against OTT's dense geometry at matmul precision "highest" (no float64
run of OTT's implicit backward here), relative 2-norm error at most 1e-3. Times: wall-clock
medians of calls blocking on their result after a compiling warm-up (5 repetitions; 3 at 65536).

    python -m bench.areas.ott_geometry [--dry-run]
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.references import f64_sinkhorn, f_error, sample_rows  # noqa: E402

AREA, EPS = "ott_geometry", 0.1
ITEMS = (("ott_sinkhorn_default", dict(n=8192, d=3), 25), ("ott_sinkhorn_default", dict(n=8192, d=64), 25),
         ("ott_sinkhorn_20it", dict(n=65536, d=3, iters=20), 35), ("ott_sinkhorn_20it", dict(n=65536, d=64, iters=20), 35),
         ("ott_divergence_grad", dict(n=8192, d=64), 40))
GEOMS = (("ours", "ot_triton_jax.ott.PointCloud"), ("ott_dense_highest", "ott PointCloud (dense)"),
         ("ott_online_highest", f"ott PointCloud(batch_size={peers.OTT_ONLINE_BATCH})"))


def geometry(method: str):
    from functools import partial

    from ott.geometry import pointcloud

    import ot_triton_jax.ott as otj_ott
    if method == "ours":
        return otj_ott.PointCloud
    if method == "ott_online_highest":
        peers.patch_ott_online()
        return partial(pointcloud.PointCloud, batch_size=peers.OTT_ONLINE_BATCH)
    return pointcloud.PointCloud


def divergence_geometry(method: str):
    """(geometry class, its keywords) for ``sinkhorn_divergence``, which takes a class."""
    from ott.geometry import pointcloud

    import ot_triton_jax.ott as otj_ott
    if method == "ours":
        return otj_ott.PointCloud, {}
    if method == "ott_online_highest":
        peers.patch_ott_online()
        return pointcloud.PointCloud, dict(batch_size=peers.OTT_ONLINE_BATCH)
    return pointcloud.PointCloud, {}


def clouds(n: int, d: int):
    gen = torch.Generator().manual_seed(n + d)
    xt = torch.randn(n, d, generator=gen) / d ** 0.5
    yt = (torch.randn(n, d, generator=gen) + 0.3) / d ** 0.5
    return xt.cuda(), yt.cuda()


def call(workload: str, sz: dict) -> str:
    solver = f"Sinkhorn(min_iterations={sz['iters']}, max_iterations={sz['iters']})" if "iters" in sz else "Sinkhorn()"
    if workload == "ott_divergence_grad":
        return "jax.jit(jax.grad(lambda x: sinkhorn_divergence(Geometry, x, y, epsilon=0.1)[0]))"
    return f"jax.jit(lambda x, y: {solver}(LinearProblem(Geometry(x, y, epsilon=0.1))))"


def measure(workload: str, sz: dict) -> list[dict]:
    import jax
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn
    from ott.tools import sinkhorn_divergence

    import ot_triton_jax as otj
    harness.after_jax_triton_import()
    n, d = sz["n"], sz["d"]
    xt, yt = clouds(n, d)
    x, y = otj.from_torch(xt), otj.from_torch(yt)
    reps, rows, results = (3 if n > 8192 else 5), sample_rows(n), {}
    it = sz.get("iters")
    solver = sinkhorn.Sinkhorn(min_iterations=it, max_iterations=it) if it else sinkhorn.Sinkhorn()
    refs = {}

    def ref_f(k: int):
        if k not in refs:
            refs[k] = f64_sinkhorn(xt, yt, k, EPS)[0]
        return refs[k]

    for method, _ in GEOMS:
        geom = geometry(method)
        try:
            with jax.default_matmul_precision("highest"):
                if workload == "ott_divergence_grad":  # OTT 0.6 returns (divergence, output)
                    cls, kw = divergence_geometry(method)
                    fn = jax.jit(jax.grad(lambda x, y, cls=cls, kw=kw: sinkhorn_divergence.sinkhorn_divergence(
                        cls, x, y, epsilon=EPS, **kw)[0]))
                    res = harness.measure(lambda: jax.block_until_ready(fn(x, y)), lambda o: {}, reps, 1, "wall")
                    res["grad"] = np.asarray(fn(x, y))
                else:
                    fn = jax.jit(lambda x, y, geom=geom: (lambda o: (o.f, o.g, o.n_iters))(
                        solver(linear_problem.LinearProblem(geom(x, y, epsilon=EPS)))))

                    def check(o):
                        f, g, k = o
                        if not harness.finite(f, g):
                            return {"failure": "non-finite output"}
                        return {"error": f_error(f, ref_f(int(k)), rows), "n_iters": int(k)}
                    res = harness.measure(lambda: jax.block_until_ready(fn(x, y)), check, reps, 1, "wall")
        except Exception as exc:
            res = harness.failed(exc)
        results[method] = res
    if workload == "ott_divergence_grad":
        ref = results.get("ott_dense_highest", {}).get("grad")
        for res in results.values():
            g = res.pop("grad", None)
            if ref is not None and g is not None and np.isfinite(g).all():
                res["error"] = float(np.linalg.norm(g - ref) / np.linalg.norm(ref))
    label = f"n={n} d={d}" + (f" {it}it" if it else "")
    tol, error_of = ((1e-3, "gradient vs OTT dense PointCloud, matmul precision highest")
                     if workload == "ott_divergence_grad" else (1e-4, "f on 512 sampled rows vs float64 of the same iterations"))
    out = []
    for method, desc in GEOMS:
        out.append(harness.row(workload, label, dict(sz, m=n, eps=EPS), method, call(workload, sz).replace("Geometry", desc),
                               results.get(method, {}), tolerance=tol, error_of=error_of, ours=method == "ours",
                               default=method == "ours", compare_to=None if method == "ours" else "ours"))
    return out


def plan(quick: bool) -> list[dict]:
    return harness.planned([harness.row(w, f"n={sz['n']} d={sz['d']}", sz, m, call(w, sz), {}, tolerance=None,
                                        error_of="", ours=m == "ours") for w, sz, _ in ITEMS for m, _ in GEOMS])


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    rows = []
    for workload, sz, est in ITEMS:
        if not budget.fits(f"{workload} n={sz['n']} d={sz['d']}", est):
            continue
        rows += measure(workload, sz)
        emit(rows)
    return rows


main = harness.cli(AREA, __doc__, plan, run)

if __name__ == "__main__":
    sys.exit(main())
