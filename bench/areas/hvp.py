"""Hessian-vector product in x of OTT's ``reg_ot_cost``: ours (torch and JAX) against flash-sinkhorn and OTT-JAX.

Workload ``hvp_x``: n = m = 8192, d = 64, eps = 0.1 (absolute), C = |x - y|^2, uniform weights,
``torch.manual_seed(0)``; x, y, v = randn (float32). Every time includes the forward solve.
Methods, in one process on the same inputs (OTT in a child process with a timeout guard):

* ``ours``: the default call ``torch_api.hvp(x, y, v, epsilon=0.1)`` (threshold 1e-3, CG rtol 1e-4,
  no preconditioner); ``ours_jacobi``: ``implicit=ImplicitOptions(preconditioner="jacobi")``
  (non-default, faster, beside it); ``ours_jax``: ``ot_triton_jax.hvp(x, y, v, epsilon=0.1)``;
* flash-sinkhorn 0.4.1: ``sinkhorn_flashstyle_alternating(..., ott_convention=True)`` (OTT's iterations,
  the same problem: cost_scale 1, eps absolute) + ``hvp_x_sqeuclid_from_potentials`` (its streaming CG
  on the same Schur system), fp32. ``flash_default``: its default 50 iterations and CG options;
  ``flash_equal_accuracy``: iterations and CG options raised along a ladder (50, 400, 800, 1600, 3200
  and our own forward count; default then tight CG) until its error is within 1.25x ours;
  ``flash_end_to_end``: its ``hvp_x_sqeuclid`` (symmetric solver) at 50 iterations;
* ``ott_jvp_grad``: OTT-JAX 0.6.0 ``jax.jvp(jax.grad(reg_ot_cost))`` with ``PointCloud`` dense,
  ``Sinkhorn(threshold=1e-3, use_danskin=False, implicit_diff=ImplicitDiff())``, precision "highest".

Gate: ||hvp - ref|| / ||ref|| at most 5e-2 against the float64 reference (references.hvp_reference:
dense float64 potentials at an L1 marginal error of 1e-10, then the exact implicit-function HVP),
which is first validated at n = m = 64, d = 4 against tests/implicit_reference.py and against
``torch.autograd.functional.hvp`` of our double backward. Ours and flash's rows also split their
error: against the float64 HVP at their own potentials (the Hessian / CG part) and that one against
the exact HVP (the forward solve's part). Times: medians of CUDA events (JAX, OTT: wall clock) of
5 (ours) / 3 (peers) calls after a warm-up call.

    python -m bench.areas.hvp [--quick] [--dry-run] [--tiny]

Takes ~250 s on an H100, most of it flash-sinkhorn's first call (compiles ~150 s) and its ladder;
``--quick`` stops the ladder at our own forward count (~200 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.references import hvp_reference_module  # noqa: E402

AREA, WORKLOAD, EPS, TOLERANCE, MATCH = "hvp", "hvp_x", 0.1, 5e-2, 1.25
ERROR_OF = "hvp vs the exact float64 implicit HVP"
CG_DEFAULT = dict(tau2=1e-5, cg_rtol=1e-6, cg_atol=1e-6, max_cg_iter=300)
CG_TIGHT = dict(tau2=1e-9, cg_rtol=1e-7, cg_atol=0.0, max_cg_iter=1000)
CALLS = {"ours": "torch_api.hvp(x, y, v, epsilon=0.1)",
         "ours_jacobi": 'torch_api.hvp(x, y, v, epsilon=0.1, implicit=ImplicitOptions(preconditioner="jacobi"))',
         "ours_jax": "ot_triton_jax.hvp(x, y, v, epsilon=0.1)",
         "flash_default": "f, g = sinkhorn_flashstyle_alternating(x, y, a, b, eps=0.1, n_iters=50, allow_tf32=False, "
                          "ott_convention=True); hvp_x_sqeuclid_from_potentials(x, y, f, g, v, eps=0.1, "
                          "allow_tf32=False, **cg_default)",
         "flash_equal_accuracy": "the same with n_iters and CG options from the ladder (row's n_iters, cg)",
         "flash_end_to_end": "hvp_x_sqeuclid(x, y, a, b, v, eps_list=[0.1] * 50, allow_tf32=False, **cg_default)",
         "ott_jvp_grad": "jax.jit(lambda x, v: jax.jvp(jax.grad(L), (x,), (v,))[1]); L(x) = linear.solve(PointCloud(x, y, "
                         "epsilon=0.1), threshold=1e-3, use_danskin=False, implicit_diff=ImplicitDiff()).reg_ot_cost"}
COMPARE = {"ours": None, "ours_jacobi": "ours", "ours_jax": "ours"}


def rows_for(n: int, d: int, results: dict) -> list[dict]:
    return [harness.row(WORKLOAD, f"n={n} d={d}", {"n": n, "m": n, "d": d, "eps": EPS}, m, CALLS[m], results.get(m, {}),
                        tolerance=TOLERANCE, error_of=ERROR_OF, ours=m.startswith("ours"), default=m == "ours",
                        compare_to=COMPARE.get(m, "ours")) for m in CALLS]


def validate_reference(R, dev: str) -> dict:
    """The float64 reference at n = m = 64, d = 4 against two independent computations."""
    import torch_api
    gen = torch.Generator().manual_seed(1)
    xs, ys, vs = (torch.randn(64, 4, generator=gen).to(dev) for _ in range(3))
    ref = R.solve_potentials(xs, ys, EPS)
    h_ref = R.hvp_reference(ref, vx=vs)[0]
    out = {}
    try:
        from implicit_reference import Problem  # tests/: torch.func jacobians + pinv, CPU float64
        a = torch.full((64,), 1.0 / 64, dtype=torch.float64)
        p = Problem(xs.cpu(), ys.cpu(), a, a, EPS)
        hp = p.hvp(vs.cpu())[0].to(dev)
        own = R.at_potentials(xs, ys, p.f.to(dev), p.g.to(dev), EPS)
        out["implicit_reference_same_potentials"] = R.rel_err(hp, R.hvp_reference(own, vx=vs)[0])
        out["implicit_reference"] = R.rel_err(hp, h_ref)
    except Exception as exc:
        out["implicit_reference_failure"] = repr(exc)[:300]
    try:
        kw = dict(epsilon=EPS, threshold=1e-5, max_iterations=20000)
        hb = torch.autograd.functional.hvp(lambda z: torch_api.sinkhorn(z, ys, **kw).reg_ot_cost, xs, vs)[1]
        o = torch_api.sinkhorn(xs, ys, **kw)
        own = R.at_potentials(xs, ys, o.f, o.g, EPS)
        out["double_backward_same_potentials"] = R.rel_err(hb, R.hvp_reference(own, vx=vs)[0])
        out["double_backward"] = R.rel_err(hb, h_ref)
    except Exception as exc:
        out["double_backward_failure"] = repr(exc)[:300]
    limits = {"implicit_reference_same_potentials": 1e-8, "implicit_reference": 1e-3,
              "double_backward_same_potentials": 1e-3, "double_backward": 1e-2}
    out["passed"] = all(harness.gate(out.get(k), lim) for k, lim in limits.items())
    return out


def own_split(R, x, y, v, f, g, C, h, h_ref) -> dict:
    own = R.at_potentials(x, y, f, g, EPS, C=C)
    h_own = R.hvp_reference(own, vx=v)[0]
    return {"marginal_error_l1": own.marginal_error, "err_vs_f64_at_own_potentials": R.rel_err(h, h_own),
            "err_f64_at_own_potentials_vs_exact": R.rel_err(h_own, h_ref)}


def cg_info(info, flash: bool = False) -> dict:
    it = info.cg_iters if flash else info.cg_iterations
    return {"cg_iterations": int(it), "cg_residual": float(info.cg_residual), "cg_converged": bool(info.cg_converged)}


def measure_ours(R, x, y, v, h_ref, C, reps: int, warm: int) -> tuple[dict, int]:
    import torch_api
    check = lambda o: {"error": R.rel_err(o[0], h_ref), **cg_info(o[1])} if harness.finite(o[0]) else {  # noqa: E731
        "failure": "non-finite output"}
    out = {"ours": harness.measure(lambda: torch_api.hvp(x, y, v, epsilon=EPS), check, reps, warm)}
    fwd = torch_api.sinkhorn(x, y, epsilon=EPS)
    h = torch_api.hvp(x, y, v, epsilon=EPS)[0]
    out["ours"].update(forward_n_iters=int(fwd.n_iters), **own_split(R, x, y, v, fwd.f, fwd.g, C, h, h_ref))
    opts = torch_api.ImplicitOptions(preconditioner="jacobi")
    out["ours_jacobi"] = harness.measure(lambda: torch_api.hvp(x, y, v, epsilon=EPS, implicit=opts), check, reps, warm)
    return out, int(fwd.n_iters)


def measure_jax(R, x, y, v, h_ref, reps: int) -> dict:
    try:
        import jax

        import ot_triton_jax as otj
        harness.after_jax_triton_import()
        xj, yj, vj = (peers.to_jax(t) for t in (x, y, v))
        return harness.measure(lambda: jax.block_until_ready(otj.hvp(xj, yj, vj, epsilon=EPS)),
                               lambda o: {"error": R.rel_err(peers.to_torch(o[0], x.device), h_ref)}, reps, 1, "wall")
    except Exception as exc:
        return harness.failed(exc)


def measure_flash(R, x, y, v, h_ref, C, target: float, ours_iters: int, quick: bool, reps: int) -> dict:
    try:
        from flash_sinkhorn.hvp import hvp_x_sqeuclid, hvp_x_sqeuclid_from_potentials
        flash = peers.flash_alternating()
    except Exception as exc:
        return {m: harness.failed(exc) for m in ("flash_default", "flash_equal_accuracy", "flash_end_to_end")}
    a = torch.full((x.shape[0],), 1.0 / x.shape[0], device=x.device)

    def alt(N, cg):
        def fn():
            f, g = flash(x, y, a, a, eps=EPS, n_iters=N, allow_tf32=False, ott_convention=True)
            return (*hvp_x_sqeuclid_from_potentials(x, y, f, g, v, eps=EPS, allow_tf32=False, **cg), f, g)
        return fn

    check = lambda o: {"error": R.rel_err(o[0], h_ref), **cg_info(o[1], True)} if harness.finite(o[0]) else {  # noqa: E731
        "failure": "non-finite output"}
    out = {"flash_default": dict(harness.measure(alt(50, CG_DEFAULT), check, reps, 1), n_iters=50, cg="default"),
           "flash_end_to_end": dict(harness.measure(
               lambda: hvp_x_sqeuclid(x, y, a, a, v, eps_list=[EPS] * 50, allow_tf32=False, **CG_DEFAULT), check,
               reps, 1), n_iters=50, cg="default")}
    ladder, best = [], None
    for N in sorted({50, 400, 800, 1600, 3200, ours_iters} if not quick else {50, 400, ours_iters}):
        for tag, cg in (("default", CG_DEFAULT), ("tight", CG_TIGHT)):
            try:
                h, info, f, g = alt(N, cg)()
                rung = {"n_iters": N, "cg": tag, "error": R.rel_err(h, h_ref), **cg_info(info, True)}
                rung.update(own_split(R, x, y, v, f, g, C, h, h_ref))
            except Exception as exc:
                rung = {"n_iters": N, "cg": tag, "failure": repr(exc)[:300]}
            ladder.append(rung)
            if rung.get("error") is not None and (best is None or rung["error"] < best["error"]):
                best = rung
            if rung.get("error", float("inf")) <= target:
                break
        if best is not None and best["error"] <= target:
            break
    if best is None:
        out["flash_equal_accuracy"] = {"ms": None, "failure": "no ladder rung ran", "ladder": ladder}
    else:
        res = harness.measure(alt(best["n_iters"], CG_TIGHT if best["cg"] == "tight" else CG_DEFAULT), check, reps, 1)
        out["flash_equal_accuracy"] = dict(res, n_iters=best["n_iters"], cg=best["cg"], ladder=ladder, target_error=target,
                                           equal_accuracy_reached=best["error"] <= target)
    return out


def ott_child(fin: str, fout: str) -> None:
    """Runs in a child process (``--ott-child IN.npz OUT.json``): a hang or crash there cannot take
    the benchmark with it. Writes {ms, first_call_s} or {failure}, and the HVP to OUT.json.npy."""
    res = {}
    try:
        import jax
        import jax.numpy as jnp
        from ott.geometry import pointcloud
        from ott.solvers import linear
        from ott.solvers.linear import implicit_differentiation as imp
        jax.config.update("jax_default_matmul_precision", "highest")
        with np.load(fin) as z:
            x, y, v = (jnp.asarray(z[k]) for k in ("x", "y", "v"))
        loss = lambda x: linear.solve(pointcloud.PointCloud(x, y, epsilon=EPS), threshold=1e-3,  # noqa: E731
                                      use_danskin=False, implicit_diff=imp.ImplicitDiff()).reg_ot_cost
        hvp = jax.jit(lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,))[1])
        t0 = time.perf_counter()
        h = np.asarray(hvp(x, v).block_until_ready())
        res["first_call_s"] = time.perf_counter() - t0
        np.save(fout + ".npy", h)
        if np.isfinite(h).all() and res["first_call_s"] < 120:
            res["ms"], res["times_ms"] = harness.wall_median_ms(lambda: hvp(x, v).block_until_ready(), reps=3, warmup=0)
    except Exception as exc:  # the failure is the result
        res["failure"] = f"{type(exc).__name__}: {exc}"[:1500]
    with open(fout, "w") as fh:
        json.dump(res, fh)


def measure_ott(R, x, y, v, h_ref, timeout_s: float = 300.0) -> dict:
    tmp = tempfile.mkdtemp(prefix="bench_hvp_ott_")
    fin, fout = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.json")
    np.savez(fin, x=x.cpu().numpy(), y=y.cpu().numpy(), v=v.cpu().numpy())
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.areas.hvp", "--ott-child", fin, fout], cwd=harness.ROOT,
                              capture_output=True, text=True, timeout=timeout_s)
        if not os.path.exists(fout):
            return {"ms": None, "failure": f"child exited {proc.returncode}: {proc.stdout[-500:]}{proc.stderr[-500:]}"}
    except subprocess.TimeoutExpired:
        return {"ms": None, "failure": f"timed out after {timeout_s:.0f} s"}
    with open(fout) as fh:
        res = json.load(fh)
    if os.path.exists(fout + ".npy"):
        res["error"] = R.rel_err(torch.from_numpy(np.load(fout + ".npy")).to(x.device), h_ref)
    return dict(res, ms=res.get("ms"))


def measure_all(n: int, d: int, dev: str, quick: bool = False, peers_on: bool = True) -> tuple[dict, dict]:
    R = hvp_reference_module()
    validation = validate_reference(R, dev)
    torch.manual_seed(0)
    x, y, v = (torch.randn(n, d, device=dev) for _ in range(3))
    ref = R.solve_potentials(x, y, EPS, threshold=1e-10, strict=False)
    h_ref, C = R.hvp_reference(ref, vx=v)[0], ref.C
    info = {"validation": validation, "reference_marginal_error_l1": ref.marginal_error}
    ref.P = ref._chol = None  # keep C for the own-potentials splits
    reps, warm = (5, 1) if dev == "cuda" else (1, 0)
    results, ours_iters = measure_ours(R, x, y, v, h_ref, C, reps, warm)
    if peers_on:  # flash before JAX: no JAX allocations on the device while the torch peers run
        target = max(MATCH * (results["ours"].get("error") or 0.0), 1e-6)
        results.update(measure_flash(R, x, y, v, h_ref, C, target, ours_iters, quick, 3))
    results["ours_jax"] = measure_jax(R, x, y, v, h_ref, reps)
    if peers_on:
        results["ott_jvp_grad"] = measure_ott(R, x, y, v, h_ref)
    if not validation["passed"]:  # no row passes on a reference that failed its own check
        for r in results.values():
            r["failure"] = r.get("failure") or "float64 reference failed its validation"
    return results, info


def plan(quick: bool) -> list[dict]:
    return harness.planned(rows_for(8192, 64, {}))


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    results, info = measure_all(8192, 64, "cuda", quick)
    print("reference:", info, flush=True)
    rows = rows_for(8192, 64, results)
    for r in rows:
        r["reference"] = info
    return rows


def tiny() -> list[dict]:
    """n = m = 64, d = 4 on the CPU (Triton interpreter): the reference, its validation and ours."""
    results, info = measure_all(64, 4, "cpu", peers_on=False)
    print("reference:", info)
    return [r for r in rows_for(64, 4, results) if r["ours"]]


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ott-child":
        ott_child(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
