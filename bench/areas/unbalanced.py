"""KL-relaxed marginals: ``torch_api.sinkhorn(tau_a, tau_b)`` against its balanced twin, flash-sinkhorn and OTT-JAX.

Workload ``unbalanced_10it``: randn clouds x, y (n = m points in d dimensions, CPU seed n + d), uniform
weights, eps = 0.1, rho = 1 on a relaxed side (OTT's tau = rho / (rho + eps) = 10/11), 10 fixed-eps
alternating iterations: n = m in {8192, 65536} x d in {3, 64} (``--quick``: n = 8192 only). Methods, in
one process on the same inputs:

* ``ours``: the default call with both marginals relaxed, ``torch_api.sinkhorn(x, y, epsilon=0.1,
  tau_a=10/11, tau_b=10/11, min_iterations=10, max_iterations=10, inner_iterations=10)`` (float32; in
  OTT's convention it also measures the relaxed marginal error after the last iteration);
* ``ours_semi``: only b relaxed (``tau_b=10/11``); ``ours_balanced``: tau_a = tau_b = 1, the same
  call otherwise (compared with ``ours``: the price of the relaxation, target <= 1.1x);
* ``flash_sinkhorn_fp32`` / ``flash_sinkhorn_semi_fp32``: ``sinkhorn_flashstyle_alternating(x, y, a, b,
  eps=0.1, n_iters=10, rho_x=1, rho_y=1 (resp. rho_y only), allow_tf32=False)`` (its unbalanced
  solver has GeomLoss's potentials only; the semi-unbalanced one adds a translation step per
  iteration), compared with ``ours`` / ``ours_semi``;
* at n = 8192: OTT-JAX dense, ``LinearProblem(PointCloud(x, y, epsilon=0.1), tau_a=tau_b=10/11)``,
  jitted, under ``jax.default_matmul_precision("highest")``.

Workload ``label_cost_10it`` (same clouds and sizes, balanced): K = 10 classes per side drawn
uniformly (random order), a (10, 10) table W (|N(0, 1)|), the cost |x - y|^2 + W[l_x, l_y]:
``ours_labelled``, the default call with ``label_x``, ``label_y``, ``label_cost`` (10 fixed
iterations; it groups the points by label for its loop), against ``ours_unlabelled``, the same call
without labels (target: <= 1.2x of it), and ``kernel_labelled_random_order``, the kernels' loop on the
clouds in their random label order (every row block mixes labels); gated against a float64 run of
the same iterations with the augmented cost.

Gate: f's relative error on 512 sampled rows against a float64 run of the same 10 iterations of the
method's own definition (references.f64_sinkhorn with tau for ours and OTT, f64_flash_unbalanced for
flash-sinkhorn), at most 1e-4. Times: medians of CUDA events (OTT: wall clock around
block_until_ready) after two warm-up calls; 10 / 5 repetitions at n = 8192 / 65536. Floors: those of
the balanced ``sinkhorn_10it`` (a relaxed half-step streams the same pairs).

    python -m bench.areas.unbalanced [--quick] [--dry-run] [--tiny]
"""

from __future__ import annotations

import math
import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.floors import floor_ms, sinkhorn_half_steps  # noqa: E402
from bench.references import f64_flash_unbalanced, f64_sinkhorn, f_error, sample_rows  # noqa: E402

AREA, WORKLOAD = "unbalanced", "unbalanced_10it"
EPS, ITERS, RHO, SMALL = 0.1, 10, 1.0, 8192
TAU = RHO / (RHO + EPS)
TOLERANCE = 1e-4
ERROR_OF = "f on 512 sampled rows vs float64 of the same 10 iterations (the method's own definition)"
ITEMS = ((8192, 3, 25), (8192, 64, 20), (65536, 3, 15), (65536, 64, 25))  # (n, d, expected seconds)
# method -> (tau_a, tau_b) of ours, (rho_x, rho_y) of flash-sinkhorn, the row it is compared with
OURS = {"ours": ((TAU, TAU), None), "ours_semi": ((1.0, TAU), None), "ours_balanced": ((1.0, 1.0), "ours")}
FLASH = {"flash_sinkhorn_fp32": ((RHO, RHO), "ours"), "flash_sinkhorn_semi_fp32": ((None, RHO), "ours_semi")}


def methods(n: int) -> list[tuple[str, str | None]]:
    out = [(m, c) for m, (_, c) in OURS.items()] + [(m, c) for m, (_, c) in FLASH.items()]
    return out + ([("ott_dense_highest", "ours")] if n <= SMALL else [])


def call_of(method: str) -> str:
    if method in OURS:
        ta, tb = OURS[method][0]
        return (f"torch_api.sinkhorn(x, y, epsilon=0.1, tau_a={ta:.6g}, tau_b={tb:.6g}, min_iterations=10, "
                "max_iterations=10, inner_iterations=10)")
    if method in FLASH:
        rx, ry = FLASH[method][0]
        return (f"sinkhorn_flashstyle_alternating(x, y, a, b, eps=0.1, n_iters=10, rho_x={rx}, rho_y={ry}, "
                "allow_tf32=False)")
    return (f"jax.jit(Sinkhorn(min_iterations=10, max_iterations=10, inner_iterations=10)(LinearProblem("
            f"PointCloud(x, y, epsilon=0.1), tau_a={TAU:.6g}, tau_b={TAU:.6g}))) under highest precision")


def rows_for(n: int, d: int, results: dict) -> list[dict]:
    rows = []
    fl, unit = floor_ms("sinkhorn_10it", n, n, d, "float32", sinkhorn_half_steps(ITERS))
    for method, compare in methods(n):
        res = results.get(method, {})
        rows.append(harness.row(WORKLOAD, f"n={n} d={d}", {"n": n, "m": n, "d": d, "eps": EPS, "rho": RHO,
                                                          "iterations": ITERS},
                                method, call_of(method), res, tolerance=TOLERANCE, error_of=ERROR_OF,
                                ours=method in OURS, default=method == "ours", compare_to=compare,
                                precision="float32", floor_ms=fl, floor_unit=unit,
                                fraction_of_floor=fl / res["ms"] if res.get("ms") else None))
    return rows


def measure_item(n: int, d: int, device: str, reps: int, warmup: int = 2) -> dict:
    import torch_api
    gen = torch.Generator().manual_seed(n + d)
    x, y = torch.randn(n, d, generator=gen).to(device), torch.randn(n, d, generator=gen).to(device)
    a = torch.full((n,), 1.0 / n, device=device)
    rows, results = sample_rows(n), {}

    def check_against(ref):
        return lambda f: {"error": f_error(f, ref, rows)} if harness.finite(f) else {"failure": "non-finite output"}

    for method, ((ta, tb), _) in OURS.items():
        check = check_against(f64_sinkhorn(x, y, ITERS, EPS, tau_a=ta, tau_b=tb)[0])
        fn = lambda ta=ta, tb=tb: torch_api.sinkhorn(x, y, epsilon=EPS, tau_a=ta, tau_b=tb,  # noqa: E731
                                                     min_iterations=ITERS, max_iterations=ITERS, inner_iterations=ITERS)
        results[method] = harness.measure(fn, lambda o, check=check: check(o.f), reps, warmup)
    for method, ((rx, ry), _) in FLASH.items():
        try:
            flash = peers.flash_alternating()
            check = check_against(f64_flash_unbalanced(x, y, ITERS, EPS, rx, ry)[0])
            fn = lambda rx=rx, ry=ry: flash(x, y, a, a, eps=EPS, n_iters=ITERS, rho_x=rx, rho_y=ry,  # noqa: E731
                                            allow_tf32=False)
            results[method] = harness.measure(fn, lambda o, check=check: check(o[0]), reps, warmup)
        except Exception as exc:  # absent or failing: its rows say so
            results[method] = harness.failed(exc)
    if n <= SMALL:
        results["ott_dense_highest"] = ott_measure(x, y, check_against(f64_sinkhorn(x, y, ITERS, EPS, tau_a=TAU,
                                                                                     tau_b=TAU)[0]), reps, warmup)
    return results


def ott_measure(x, y, check, reps: int, warmup: int) -> dict:
    try:
        import jax
        from ott.geometry import pointcloud
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn
        solver = sinkhorn.Sinkhorn(min_iterations=ITERS, max_iterations=ITERS, inner_iterations=10)

        @jax.jit
        def solve(x, y):
            geom = pointcloud.PointCloud(x, y, epsilon=EPS)
            out = solver(linear_problem.LinearProblem(geom, tau_a=TAU, tau_b=TAU))
            return out.f, out.g

        xj, yj = peers.to_jax(x), peers.to_jax(y)
        with jax.default_matmul_precision("highest"):
            return harness.measure(lambda: jax.block_until_ready(solve(xj, yj)),
                                   lambda o: check(peers.to_torch(o[0], x.device)), reps, warmup, kind="wall")
    except Exception as exc:
        return harness.failed(exc)


LABEL_WORKLOAD, K_LABELS = "label_cost_10it", 10
# method: (what it runs, compared with)
LABEL_METHODS = {
    "ours_labelled": ("torch_api.sinkhorn(x, y, epsilon=0.1, label_x=lx, label_y=ly, label_cost=W, min_iterations=10, "
                      "max_iterations=10, inner_iterations=10)", "ours_unlabelled"),
    "ours_unlabelled": ("the same call without labels", None),
    "kernel_labelled_random_order": ("10 x (kernel_ops.lse_update(Y, X, f, ...), kernel_ops.lse_update(X, Y, g, ...)) "
                                     "on clouds(x, y, labels=(lx, ly), label_cost=W) in random label order",
                                     "ours_labelled"),
}


def label_rows_for(n: int, d: int, results: dict) -> list[dict]:
    fl, unit = floor_ms("sinkhorn_10it", n, n, d, "float32", 2 * ITERS)
    return [harness.row(LABEL_WORKLOAD, f"n={n} d={d}", {"n": n, "m": n, "d": d, "eps": EPS, "classes": K_LABELS,
                                                         "iterations": ITERS},
                        method, what, results.get(method, {}), tolerance=TOLERANCE, error_of=ERROR_OF, ours=True,
                        default=method == "ours_labelled", compare_to=compare, precision="float32", floor_ms=fl,
                        floor_unit=unit)
            for method, (what, compare) in LABEL_METHODS.items()]


def measure_labels(n: int, d: int, device: str, reps: int, warmup: int = 2) -> dict:
    import torch_api
    from torch_api import kernel_ops
    gen = torch.Generator().manual_seed(n + d)
    x, y = torch.randn(n, d, generator=gen).to(device), torch.randn(n, d, generator=gen).to(device)
    lx, ly = (torch.randint(0, K_LABELS, (n,), generator=gen, dtype=torch.int32).to(device) for _ in range(2))
    W = torch.randn(K_LABELS, K_LABELS, generator=gen).abs().to(device)
    lw = torch.full((n,), -math.log(n), device=device)
    prm = torch.tensor([EPS, 1.0], device=device)
    rows, results = sample_rows(n), {}
    X64, Y64, Wd = x.double(), y.double(), W.double()
    refs = {}
    for labelled in (True, False):  # float64 reference of the same iterations, dense in row chunks
        f, g = torch.zeros(n, dtype=torch.float64, device=device), torch.zeros(n, dtype=torch.float64, device=device)
        for _ in range(ITERS):
            g = _lse64(Y64, X64, f, Wd.T[ly.long()][:, lx.long()] if labelled else None, n)
            f = _lse64(X64, Y64, g, Wd[lx.long()][:, ly.long()] if labelled else None, n)
        refs[labelled] = f

    def check(ref):
        return lambda fk: {"error": f_error(fk, ref, rows)} if harness.finite(fk) else {"failure": "non-finite output"}

    loop_kw = dict(epsilon=EPS, min_iterations=ITERS, max_iterations=ITERS, inner_iterations=ITERS)
    results["ours_labelled"] = harness.measure(
        lambda: torch_api.sinkhorn(x, y, label_x=lx, label_y=ly, label_cost=W, **loop_kw),
        lambda o: check(refs[True])(o.f), reps, warmup)
    results["ours_unlabelled"] = harness.measure(lambda: torch_api.sinkhorn(x, y, **loop_kw),
                                                 lambda o: check(refs[False])(o.f), reps, warmup)
    X, Y = kernel_ops.clouds(x, y, labels=(lx, ly), label_cost=W)

    def loop():
        fk = torch.zeros(n, device=device)
        gk = torch.zeros(n, device=device)
        for it in range(ITERS):
            gk, _ = kernel_ops.lse_update(Y, X, fk, prm, "float32", logw_out=lw, pold=gk, compute_err=False,
                                          fold=it > 0)
            fk, _ = kernel_ops.lse_update(X, Y, gk, prm, "float32", logw_out=lw, pold=fk, compute_err=False,
                                          fold=True)
        return fk

    results["kernel_labelled_random_order"] = harness.measure(loop, check(refs[True]), reps, warmup)
    return results


def _lse64(src, tgt, pot, extra, n: int, chunk: int = 2048):
    """eps log(1/n) - eps LSE_j((pot_j - |src_i - tgt_j|^2 - extra_ij)/eps) in float64."""
    out = torch.empty(src.shape[0], dtype=torch.float64, device=src.device)
    for i in range(0, src.shape[0], chunk):
        C = torch.cdist(src[i:i + chunk], tgt) ** 2
        if extra is not None:
            C = C + extra[i:i + chunk]
        out[i:i + chunk] = -EPS * math.log(n) - EPS * torch.logsumexp((pot[None] - C) / EPS, 1)
    return out


def plan(quick: bool) -> list[dict]:
    return harness.planned([r for n, d, _ in ITEMS if not quick or n <= SMALL
                            for r in rows_for(n, d, {}) + label_rows_for(n, d, {})])


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    rows = []
    for n, d, est in ITEMS:
        if (quick and n > SMALL) or not budget.fits(f"{WORKLOAD} n={n} d={d}", est):
            continue
        try:
            results = measure_item(n, d, "cuda", 10 if n <= SMALL else 5)
        except Exception as exc:  # the inputs or the references failed: every row says so
            results = {m: harness.failed(exc) for m, _ in methods(n)}
        rows += rows_for(n, d, results)
        try:
            labels = measure_labels(n, d, "cuda", 10 if n <= SMALL else 5)
        except Exception as exc:
            labels = {m: harness.failed(exc) for m in LABEL_METHODS}
        rows += label_rows_for(n, d, labels)
        emit(rows)
        torch.cuda.empty_cache()
    return rows


def tiny() -> list[dict]:
    """n = m = 64, d = 3 on the CPU (Triton interpreter): our code paths, one repetition."""
    return (rows_for(64, 3, measure_item(64, 3, "cpu", reps=1, warmup=0))
            + label_rows_for(64, 3, measure_labels(64, 3, "cpu", reps=1, warmup=0)))


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
