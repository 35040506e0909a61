"""Multiscale Sinkhorn (d = 3): ``SamplesLoss(backend="multiscale")`` against flash-sinkhorn's multiscale mode.

Workloads (d = 3, uniform weights, CPU seed n), in one process on the same inputs:

* ``multiscale_loss_grad`` on ``uniform`` clouds (x, y ~ U[0, 1]^3, flash-sinkhorn's own multiscale
  example) at n = m in {2^16, 2^18, 2^20, 2^22} (``--quick``: 2^16 and 2^20), and on ``randn`` clouds
  (x ~ N(0, I), y ~ N(0.5, I)) at 2^16 (not in ``--quick``): GeomLoss conventions, blur 0.05, scaling
  0.5, debias. ``ours``: the default call ``torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5,
  backend="multiscale")``, loss + gradient in x (truncate=5, tol=5e-3, the default cluster scale);
  ``ours_jax``: its JAX twin ``jax.value_and_grad`` of ``ot_triton_jax.samples_loss(...,
  backend="multiscale")`` (eager: it runs the same solve through DLPack); ``flash_sinkhorn_multiscale``:
  flash-sinkhorn 0.4.1 ``SamplesLoss(..., half_cost=True, backend="multiscale")`` with its default
  tol 5e-3, **forward only** (it has no gradients), up to 2^20.
* ``multiscale_ott`` at 2^16 uniform: the OTT-convention option, ``torch_api.sinkhorn(x, y,
  epsilon=0.0025, scale_cost=2.0, threshold=5e-3, multiscale=torch_api.MultiscaleOptions())``,
  ``reg_ot_cost`` + gradient in x, against the dense solver on the same problem (``dense``, converged
  to the same threshold).

Gate (``multiscale_loss_grad``, n <= 2^18): the value's relative difference from the reference, our
solve with every block kept (``truncate=None``) converged to ``tol=1e-5``, at most 5e-2 (the default
tol=5e-3 stops at a marginal error of 5e-3; the reference's own accuracy against float64 is the dense
tests' subject); above 2^18 there is no reference and a row passes on a finite value and gradient.
``multiscale_ott``: the cost's relative difference from the dense solve, at most 1e-3. Times: medians
of CUDA events (JAX: wall clock) of 5 calls after a warm-up call (1 call where the first took > 20 s);
the first call's wall time, peak memory and the solve's report (clusters, kept fraction, sweeps,
marginal error, dropped-mass bound) are recorded.

    python -m bench.areas.multiscale [--quick] [--dry-run]

Takes ~200 s on an H100, flash-sinkhorn's first calls (~30 s each) and the randn row (its solve
~16 s a call) most of it (``--quick`` ~90 s).
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness, peers  # noqa: E402

AREA, BLUR, SCALING, REPS, REF_TOL = "multiscale", 0.05, 0.5, 5, 1e-5
TOL_VALUE, TOL_OTT = 5e-2, 1e-3
# (data, n, expected seconds on the H100); cheap first
ITEMS = (("uniform", 1 << 16, 50), ("uniform", 1 << 18, 40), ("uniform", 1 << 20, 30), ("uniform", 1 << 22, 25),
         ("randn", 1 << 16, 130))
QUICK = (("uniform", 1 << 16), ("uniform", 1 << 20))
OURS = f'torch_api.SamplesLoss("sinkhorn", blur={BLUR}, scaling={SCALING}, backend="multiscale"): loss + grad'
CALLS = {"ours": OURS,
         "ours_jax": f'jax.value_and_grad(lambda x: ot_triton_jax.samples_loss(x, y, blur={BLUR}, scaling={SCALING}, '
                     'backend="multiscale")), eager',
         "flash_sinkhorn_multiscale": f"flash_sinkhorn.samples_loss.SamplesLoss('sinkhorn', p=2, blur={BLUR}, "
                                      f"scaling={SCALING}, debias=True, half_cost=True, backend='multiscale'): forward only",
         "ours_ott": "torch_api.sinkhorn(x, y, epsilon=0.0025, scale_cost=2.0, threshold=5e-3, "
                     "multiscale=torch_api.MultiscaleOptions()): reg_ot_cost + grad",
         "dense": "torch_api.sinkhorn(x, y, epsilon=0.0025, scale_cost=2.0, threshold=5e-3, max_iterations=100000): "
                  "reg_ot_cost + grad"}


def clouds(n: int, data: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    if data == "uniform":
        return torch.rand(n, 3, generator=g).cuda(), torch.rand(n, 3, generator=g).cuda()
    return torch.randn(n, 3, generator=g).cuda(), (torch.randn(n, 3, generator=g) + 0.5).cuda()


def methods(n: int) -> list[str]:
    return ["ours", "ours_jax"] + (["flash_sinkhorn_multiscale"] if n <= 1 << 20 else [])


def rows_for(data: str, n: int, results: dict) -> list[dict]:
    sizes = {"n": n, "m": n, "d": 3, "data": data, "blur": BLUR, "scaling": SCALING}
    return [harness.row("multiscale_loss_grad", f"{data} n=2^{n.bit_length() - 1}", sizes, m, CALLS[m],
                        results.get(m, {}), tolerance=TOL_VALUE, error_of="value vs our solve with every block kept, "
                        f"tol={REF_TOL}", ours=m.startswith("ours"), default=m == "ours",
                        compare_to=None if m == "ours" else "ours", finite_only=n > 1 << 18) for m in methods(n)]


def ott_rows(results: dict) -> list[dict]:
    sizes = {"n": 1 << 16, "m": 1 << 16, "d": 3, "data": "uniform", "epsilon": BLUR ** 2, "threshold": 5e-3}
    return [harness.row("multiscale_ott", "uniform n=2^16", sizes, m, CALLS[m], results.get(m, {}), tolerance=TOL_OTT,
                        error_of="reg_ot_cost vs the dense solve", ours=True, default=m == "ours_ott",
                        compare_to=None if m == "ours_ott" else "ours_ott") for m in ("ours_ott", "dense")]


def timed(call, reps: int = REPS, kind: str = "cuda") -> dict:
    """First call's wall time, then the median of ``reps`` calls (1 when the first took > 20 s)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    ms, times = harness.median_ms(call, reps if first < 20 else 1, 0, kind)
    return {"ms": ms, "times_ms": times, "first_call_s": first, "peak_mib": torch.cuda.max_memory_allocated() / 2 ** 20,
            "out": out}


def report(res) -> dict:
    return {k: getattr(res, k, None) for k in ("kept", "jump", "sweeps", "finish_sweeps", "taylor_passes",
                                              "marginal_error", "converged", "dropped_mass_bound")} | {
        "clusters": list(getattr(res, "clusters", []) or [])}


def measure_item(data: str, n: int) -> dict:
    import torch_api
    x, y = clouds(n, data)
    ref = None
    if n <= 1 << 18:  # every block kept, converged tightly
        loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale", truncate=None,
                                     tol=REF_TOL)
        ref = float(loss(x, y))

    def check(value, grad=None):
        if not harness.finite(value, *([] if grad is None else [grad])):
            return {"failure": "non-finite output"}
        out = {"value": float(value)}
        return out if ref is None else dict(out, error=abs(float(value) - ref) / abs(ref), reference_value=ref)

    out = {}
    loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")

    def ours():
        xg = x.detach().requires_grad_(True)
        value = loss(xg, y)
        return value.detach(), torch.autograd.grad(value, xg)[0]
    try:
        t = timed(ours)
        out["ours"] = dict(t, **check(*t.pop("out")), **report(loss.last_multiscale))
    except Exception as exc:
        out["ours"] = harness.failed(exc)
    try:
        import jax

        import ot_triton_jax as otj
        harness.after_jax_triton_import()
        xj, yj = otj.from_torch(x.contiguous()), otj.from_torch(y.contiguous())
        f = jax.value_and_grad(lambda z: otj.samples_loss(z, yj, blur=BLUR, scaling=SCALING, backend="multiscale"))
        t = timed(lambda: jax.block_until_ready(f(xj)), kind="wall")
        value, grad = (peers.to_torch(v, "cuda") for v in t.pop("out"))
        out["ours_jax"] = dict(t, **check(value, grad))
    except Exception as exc:
        out["ours_jax"] = harness.failed(exc)
    if "flash_sinkhorn_multiscale" in methods(n):
        try:
            floss = peers.flash_multiscale(BLUR, SCALING)
            t = timed(lambda: floss(x, y))
            out["flash_sinkhorn_multiscale"] = dict(t, **check(t.pop("out")))
        except Exception as exc:
            out["flash_sinkhorn_multiscale"] = harness.failed(exc)
    return out


def measure_ott() -> dict:
    import torch_api
    x, y = clouds(1 << 16, "uniform")
    kw = dict(epsilon=BLUR ** 2, scale_cost=2.0, threshold=5e-3)

    def call(**extra):
        xg = x.detach().requires_grad_(True)
        o = torch_api.sinkhorn(xg, y, **kw, **extra)
        return o, torch.autograd.grad(o.reg_ot_cost, xg)[0]
    out = {}
    try:
        t0 = time.perf_counter()
        dense, gd = call(max_iterations=100000)
        torch.cuda.synchronize()
        out["dense"] = {"ms": (time.perf_counter() - t0) * 1e3, "note": "one call, first call included",
                        "error": 0.0 if harness.finite(dense.reg_ot_cost, gd) else float("nan"),
                        "n_iters": int(dense.n_iters), "converged": bool(dense.converged)}
        cost = float(dense.reg_ot_cost)
        opts = torch_api.MultiscaleOptions()
        t = timed(lambda: call(multiscale=opts))
        o, g = t.pop("out")
        out["ours_ott"] = dict(t, error=abs(float(o.reg_ot_cost) - cost) / abs(cost) if harness.finite(o.reg_ot_cost, g)
                               else float("nan"), grad_rel_diff_vs_dense=harness.rel(g, gd),
                               marginal_error=float(o.marginal_error), converged=bool(o.converged))
    except Exception as exc:
        out.setdefault("ours_ott", harness.failed(exc))
        out.setdefault("dense", harness.failed(exc))
    return out


def plan(quick: bool) -> list[dict]:
    items = QUICK if quick else [(d, n) for d, n, _ in ITEMS]
    return harness.planned([r for d, n in items for r in rows_for(d, n, {})] + ott_rows({}))


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    rows = []
    for data, n, est in ITEMS:
        if (quick and (data, n) not in QUICK) or not budget.fits(f"multiscale {data} n={n}", est):
            continue
        rows += rows_for(data, n, measure_item(data, n))
        emit(rows)
        torch.cuda.empty_cache()
    if budget.fits("multiscale_ott", 20):
        rows += ott_rows(measure_ott())
    return rows


main = harness.cli(AREA, __doc__, plan, run)

if __name__ == "__main__":
    sys.exit(main())
