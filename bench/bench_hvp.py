"""Hessian-vector product of OTT's reg_ot_cost in x: ours (torch and JAX) vs flash-sinkhorn 0.4.1 and OTT-JAX 0.6.0.

Workload: n = m = 8192, d = 64, eps = 0.1 (absolute), C = |x - y|^2 (scale_cost 1), uniform
weights, randn clouds x, y and direction v = randn like x (seeded). Every timing includes the
forward solve. Accuracy: relative error ||hvp - ref|| / ||ref|| against a float64 reference on
the same device (tests/hvp_reference_gpu.py: dense float64 potentials solved to an L1 marginal
error of 1e-10 by Sinkhorn + Newton, then the exact implicit-function HVP by a Cholesky
factorisation of the Schur complement). For ours and flash the error is also split: the HVP
against the float64 implicit HVP at the method's *own* potentials (the error of its
Hessian / CG part) and that float64 HVP against the exact one (the part due to the forward
solve's accuracy).

  f. float64 reference (time, Newton steps); validated at n = m = 64, d = 4 against
     tests/implicit_reference.py (Problem(...).hvp), against torch.autograd.functional.hvp of
     our double backward, and against flash-sinkhorn's dense formula (where importable).
  a. ours torch: torch_api.hvp(x, y, v, epsilon=0.1), default options (threshold 1e-3):
     time, CG record, error; the forward alone (iterations, time); an accuracy ladder at
     tighter thresholds (one call each).
  b. ours torch per preconditioner: none (= a, the default), jacobi, neumann with 1, 2, 3 terms.
  c. ours JAX: ot_triton_jax.hvp (jitted; time after a warm-up call), error, JAX / torch.
  d. flash-sinkhorn 0.4.1 (CUDA only): sinkhorn_flashstyle_alternating(..., ott_convention=True)
     (OTT's alternating iterations, g then f, fixed count) + hvp_x_sqeuclid_from_potentials
     (its OTT-Hessian-style streaming CG on the same Schur system; cost_scale=1.0 is the full
     |x - y|^2, eps absolute: the same problem, no rescaling), allow_tf32=False on both (ours is
     float32). Its iteration count and CG options are raised along a ladder until its error is
     within MATCH x ours (equal accuracy); its default rung (50 iterations, CG defaults) and
     flash's end-to-end hvp_x_sqeuclid (symmetric solver, GeomLoss potentials converted) are
     recorded too. speedup = flash_ms / ours_ms.
  e. OTT-JAX 0.6.0 (subprocess, timeout guard): jax.jvp(jax.grad(reg_ot_cost)) with
     PointCloud dense, Sinkhorn(threshold=1e-3, use_danskin=False, implicit_diff=ImplicitDiff()),
     matmul precision "highest": time, or how it failed.

Writes bench/results/hvp_vs_flash_<device>.json (``--smoke``: a temporary file) and prints a table.

    python bench/bench_hvp.py [--n 8192] [--d 64] [--smoke]

``--smoke``: n = m = 64, d = 4, one rep; runs on CPU (Triton interpreter) and records the
CUDA-only peers as skipped.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

EPS = 0.1
OTT_FIRST_CALL_GUARD_S = 120.0


# ---------------------------------------------------------------------------------------------
# e. OTT-JAX, run in a child process (``--ott-child IN.npz OUT.json``): a hang or a crash there
# cannot take the benchmark with it, and the parent can kill it on a timeout.
# ---------------------------------------------------------------------------------------------

def ott_child(fin: str, fout: str) -> None:
    import numpy as np

    res: dict = {"stage": "import"}

    def dump():
        with open(fout + ".tmp", "w") as fh:
            json.dump(res, fh)
        os.replace(fout + ".tmp", fout)

    try:
        import jax
        import jax.numpy as jnp
        from ott.geometry import pointcloud
        from ott.solvers import linear
        from ott.solvers.linear import implicit_differentiation as imp

        jax.config.update("jax_default_matmul_precision", "highest")
        with np.load(fin) as z:
            x, y, v = (jnp.asarray(z[k]) for k in ("x", "y", "v"))
            eps, reps, thr = float(z["eps"]), int(z["reps"]), float(z["threshold"])
        res.update(jax_backend=jax.default_backend(), matmul_precision="highest", threshold=thr,
                   call="jax.jit(lambda x, v: jax.jvp(jax.grad(L), (x,), (v,))[1]); L(x) = linear.solve("
                        "PointCloud(x, y, epsilon=eps), threshold=thr, use_danskin=False, "
                        "implicit_diff=ImplicitDiff()).reg_ot_cost")

        def solve(x):
            return linear.solve(pointcloud.PointCloud(x, y, epsilon=eps), threshold=thr, use_danskin=False,
                                implicit_diff=imp.ImplicitDiff())

        loss = lambda x: solve(x).reg_ot_cost  # noqa: E731
        hvp = jax.jit(lambda x, v: jax.jvp(jax.grad(loss), (x,), (v,))[1])
        res["stage"] = "forward"
        out = jax.jit(solve)(x)
        res.update(forward_n_iters=int(out.n_iters), forward_converged=bool(out.converged))
        res["stage"] = "first_call"
        dump()
        t0 = time.perf_counter()
        h = hvp(x, v).block_until_ready()
        res["first_call_s"] = time.perf_counter() - t0  # compile + run
        h = np.asarray(h)
        finite = bool(np.isfinite(h).all())
        res.update(finite=finite, nonfinite_count=int((~np.isfinite(h)).sum()))
        np.save(fout + ".hvp.npy", h)
        res["stage"] = "reps"
        dump()
        if res["first_call_s"] > OTT_FIRST_CALL_GUARD_S:
            res["skipped_reps"] = f"first call took {res['first_call_s']:.0f} s > {OTT_FIRST_CALL_GUARD_S:.0f} s"
        elif not finite:
            res["skipped_reps"] = "non-finite values"
        else:
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                hvp(x, v).block_until_ready()
                ts.append((time.perf_counter() - t0) * 1e3)
            res.update(ms=sorted(ts)[len(ts) // 2], all_ms=ts)
        res["stage"] = "done"
    except Exception as exc:  # recorded, never raised: the failure is a result
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        res["traceback"] = traceback.format_exc()[-3000:]
    dump()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--ott-child":
    ott_child(sys.argv[2], sys.argv[3])
    sys.exit(0)


# ---------------------------------------------------------------------------------------------

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from common import cuda_median_ms, environment, wall_median_ms, write  # noqa: E402
from hvp_reference_gpu import at_potentials, hvp_reference, rel_err, solve_potentials  # noqa: E402

import torch_api  # noqa: E402  (switches to the Triton interpreter without CUDA)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
T_START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T_START


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timer(fn, reps, warmup):
    """Median ms and all reps: CUDA events on the GPU, wall clock on the CPU."""
    if CUDA:
        return cuda_median_ms(fn, reps=reps, warmup=warmup)
    return wall_median_ms(fn, reps=reps, warmup=warmup)


def once_s(fn, *args, **kw):
    sync()
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    sync()
    return out, time.perf_counter() - t0


def free():
    if CUDA:
        torch.cuda.empty_cache()


def torch_hvp():
    fn = torch_api.hvp
    return fn if callable(fn) else fn.hvp  # (a package attribute that is the submodule: its function)


def info_dict(info) -> dict:
    return {"cg_iterations": int(info.cg_iterations), "cg_residual": float(info.cg_residual),
            "cg_converged": bool(info.cg_converged), "solve_converged": bool(info.solve_converged)}


def own_split(x, y, v, f, g, C, h, h_ref) -> dict:
    """Error of h against the float64 HVP at the potentials (f, g) that produced it, and that
    float64 HVP against the exact one."""
    own = at_potentials(x, y, f, g, EPS, C=C)
    h_own = hvp_reference(own, vx=v)[0]
    out = {"marginal_error_l1": own.marginal_error, "err_vs_f64_at_own_potentials": rel_err(h, h_own),
           "err_f64_at_own_potentials_vs_exact": rel_err(h_own, h_ref)}
    del own, h_own
    free()
    return out


# --------------------------------------------------------------------------------- f. reference

def validate_reference(seed: int) -> dict:
    """The float64 reference at n = m = 64, d = 4 against two independent computations."""
    n, d = 64, 4
    g_ = torch.Generator().manual_seed(seed + 1)
    xs, ys, vs = (torch.randn(n, d, generator=g_).to(DEV) for _ in range(3))
    rec: dict = {"n": n, "m": n, "d": d, "eps": EPS}
    ref = solve_potentials(xs, ys, EPS)
    h_ref = hvp_reference(ref, vx=vs)[0]
    rec["reference_marginal_error"] = ref.marginal_error
    checks = {}
    # tests/implicit_reference.py: torch.func jacobians + pinv of the full (n+m) system, CPU float64
    try:
        from implicit_reference import Problem

        a = torch.full((n,), 1.0 / n, dtype=torch.float64)
        p = Problem(xs.cpu(), ys.cpu(), a, a, EPS)
        hp = p.hvp(vs.cpu())[0]
        own = at_potentials(xs, ys, p.f.to(DEV), p.g.to(DEV), EPS)
        rec["implicit_reference"] = {
            "err_vs_reference_at_same_potentials": rel_err(hp.to(DEV), hvp_reference(own, vx=vs)[0]),
            "err_vs_reference": rel_err(hp.to(DEV), h_ref),
            "its_marginal_error_l1": own.marginal_error,
            "note": "Problem solves by plain Sinkhorn (20000 iterations); the same-potentials number checks the "
                    "formula, the other includes its forward accuracy"}
        checks["implicit_reference_same_potentials"] = rec["implicit_reference"]["err_vs_reference_at_same_potentials"] < 1e-8
        checks["implicit_reference"] = rec["implicit_reference"]["err_vs_reference"] < 1e-3
    except Exception as exc:
        rec["implicit_reference"] = {"error": repr(exc)[:500]}
        checks["implicit_reference"] = False
    # torch.autograd.functional.hvp of our double backward (float32, tight forward threshold)
    try:
        kw = dict(epsilon=EPS, threshold=1e-5, max_iterations=20000)
        loss = lambda z: torch_api.sinkhorn(z, ys, **kw).reg_ot_cost  # noqa: E731
        hb = torch.autograd.functional.hvp(loss, xs, vs)[1]
        out = torch_api.sinkhorn(xs, ys, **kw)
        own = at_potentials(xs, ys, out.f, out.g, EPS)
        rec["double_backward"] = {
            "call": "torch.autograd.functional.hvp(lambda x: torch_api.sinkhorn(x, y, epsilon=0.1, threshold=1e-5, "
                    "max_iterations=20000).reg_ot_cost, x, v)",
            "err_vs_reference_at_same_potentials": rel_err(hb, hvp_reference(own, vx=vs)[0]),
            "err_vs_reference": rel_err(hb, h_ref), "its_marginal_error_l1": own.marginal_error}
        checks["double_backward_same_potentials"] = rec["double_backward"]["err_vs_reference_at_same_potentials"] < 1e-3
        checks["double_backward"] = rec["double_backward"]["err_vs_reference"] < 1e-2
    except Exception as exc:
        rec["double_backward"] = {"error": repr(exc)[:500]}
        checks["double_backward"] = False
    # flash-sinkhorn's dense HVP formula (testing/reference_hvp.py, float32, pure torch) at the
    # reference's potentials: the problem mapping (its Hessian is the Hessian we compute)
    try:
        from flash_sinkhorn.testing.reference_hvp import hvp_x_dense_sqeuclid

        hf, finfo = hvp_x_dense_sqeuclid(xs, ys, ref.f.float(), ref.g.float(), vs, eps=EPS, tau2=1e-12,
                                         cg_rtol=1e-7, cg_atol=0.0, max_cg_iter=1000)
        rec["flash_dense_formula"] = {"err_vs_reference": rel_err(hf, h_ref), "cg": finfo,
                                      "call": "flash_sinkhorn.testing.reference_hvp.hvp_x_dense_sqeuclid(x, y, f, g, v, "
                                              "eps=0.1, tau2=1e-12, cg_rtol=1e-7, cg_atol=0, max_cg_iter=1000) "
                                              "(float32) at the reference potentials"}
        checks["flash_dense_formula"] = rec["flash_dense_formula"]["err_vs_reference"] < 1e-3
    except ImportError as exc:
        rec["flash_dense_formula"] = {"skipped": f"flash_sinkhorn not importable: {exc}"}
    except Exception as exc:
        rec["flash_dense_formula"] = {"error": repr(exc)[:500]}
        checks["flash_dense_formula"] = False
    rec["checks"] = checks
    rec["passed"] = all(checks.values())
    return rec


# ------------------------------------------------------------------------------------ d. flash

def flash_section(x, y, v, h_ref, C, target_err, ours_iters, reps, deadline) -> dict:
    rec: dict = {}
    if not CUDA:
        return {"skipped": "needs CUDA (flash-sinkhorn's kernels and HVP refuse CPU tensors)"}
    try:
        from flash_sinkhorn.hvp import hvp_x_sqeuclid, hvp_x_sqeuclid_from_potentials
        from flash_sinkhorn.sinkhorn_solvers import sinkhorn_flashstyle_alternating
    except Exception as exc:
        return {"skipped": f"flash_sinkhorn not importable: {exc!r}"[:500]}
    n, m = x.shape[0], y.shape[0]
    a = torch.full((n,), 1.0 / n, device=DEV)
    b = torch.full((m,), 1.0 / m, device=DEV)
    cg_default = dict(tau2=1e-5, cg_rtol=1e-6, cg_atol=1e-6, max_cg_iter=300)
    cg_tight = dict(tau2=1e-9, cg_rtol=1e-7, cg_atol=0.0, max_cg_iter=1000)
    rec["problem_mapping"] = (
        "identical problem, no rescaling: flash's cost_scale=1.0 (default) is the full |x - y|^2 = OTT's "
        "PointCloud cost with scale_cost=1, eps=0.1 is absolute in both, uniform a, b; "
        "sinkhorn_flashstyle_alternating(ott_convention=True) runs OTT's alternating updates (g then f) and returns "
        "OTT potentials (P = exp((f + g - C)/eps)), which hvp_x_sqeuclid_from_potentials takes as f_hat, g_hat; "
        "its HVP is the Hessian in x of OTT's reg_ot_cost (validation.flash_dense_formula checks its formula "
        "against our float64 reference). Not used: the GeomLoss-style SamplesLoss, whose p = 2 cost is |x - y|^2 / 2 with "
        "eps = blur^2; the same plan would need blur^2 = eps / 2 = 0.05 (blur = 0.2236) on that halved cost, and its "
        "loss (and so its Hessian in x) would be half of OTT's up to terms constant in x.")
    rec["calls"] = {
        "alternating": "f, g = sinkhorn_flashstyle_alternating(x, y, a, b, eps=0.1, n_iters=N, allow_tf32=False, "
                       "ott_convention=True); h, info = hvp_x_sqeuclid_from_potentials(x, y, f, g, v, eps=0.1, "
                       "allow_tf32=False, **cg)",
        "end_to_end": "h, info = hvp_x_sqeuclid(x, y, a, b, v, eps_list=[0.1] * N, allow_tf32=False, **cg) "
                      "(symmetric solver, prelast GeomLoss potentials converted to OTT's)"}
    rec["cg_default"], rec["cg_tight"] = cg_default, cg_tight
    rec["target_err"] = target_err

    def alt(N, cg):
        def fn():
            f, g = sinkhorn_flashstyle_alternating(x, y, a, b, eps=EPS, n_iters=N, allow_tf32=False,
                                                   ott_convention=True)
            h, info = hvp_x_sqeuclid_from_potentials(x, y, f, g, v, eps=EPS, allow_tf32=False, **cg)
            return h, info, f, g
        return fn

    def e2e(N, cg):
        return lambda: hvp_x_sqeuclid(x, y, a, b, v, eps_list=[EPS] * N, allow_tf32=False, **cg)

    def cg_rec(info):
        return {"cg_iterations": int(info.cg_iters), "cg_residual": float(info.cg_residual),
                "cg_converged": bool(info.cg_converged)}

    ladder, best, match = [], None, None
    # 50: flash's default; then rungs around our own forward iteration count (its first call compiles ~150 s)
    Ns = sorted({50, 400, 800, 1600, 3200} | ({int(ours_iters)} if ours_iters else set()))
    for N in Ns:
        if elapsed() > deadline:
            rec["ladder_stopped"] = f"time budget ({deadline:.0f} s) reached before N={N}"
            break
        f = g = None
        for tag, cg in (("default", cg_default), ("tight", cg_tight)):
            try:
                (h, info, f, g), s = once_s(alt(N, cg))
                row = {"n_iters": N, "cg": tag, "seconds_one_call": s, "err_vs_exact": rel_err(h, h_ref), **cg_rec(info)}
                if tag == "default":
                    split = own_split(x, y, v, f, g, C, h, h_ref)
                else:
                    own = at_potentials(x, y, f, g, EPS, C=C)
                    split = {"err_vs_f64_at_own_potentials": rel_err(h, hvp_reference(own, vx=v)[0])}
                    del own
                    free()
                row.update(split)
            except Exception as exc:
                row = {"n_iters": N, "cg": tag, "error": repr(exc)[:500]}
            ladder.append(row)
            print("  flash", row, flush=True)
            err = row.get("err_vs_exact", float("inf"))
            if best is None or err < best["err_vs_exact"]:
                best = row if "err_vs_exact" in row else best
            if err <= target_err and match is None:
                match = row
                break
        if match is not None:
            break
    rec["ladder"] = ladder

    def timed(kind, N, tag):
        cg = cg_default if tag == "default" else cg_tight
        fn = alt(N, cg) if kind == "alternating" else e2e(N, cg)
        box = {}
        t, ts = cuda_median_ms(lambda: box.__setitem__("out", fn()), reps=reps, warmup=1)
        h, info = box["out"][0], box["out"][1]
        return {"kind": kind, "n_iters": N, "cg": tag, "ms": t, "all_ms": ts, "err_vs_exact": rel_err(h, h_ref),
                **cg_rec(info)}

    for key, kind, N, tag in (("default_alternating", "alternating", 50, "default"),
                              ("default_end_to_end", "end_to_end", 50, "default")):
        try:
            rec[key] = timed(kind, N, tag)
        except Exception as exc:
            rec[key] = {"error": repr(exc)[:500]}
        print("  flash", key, rec[key], flush=True)
    chosen = match or best
    rec["equal_accuracy_reached"] = match is not None
    if chosen is not None:
        try:
            rec["at_equal_accuracy"] = timed("alternating", chosen["n_iters"], chosen["cg"])
        except Exception as exc:
            rec["at_equal_accuracy"] = {"error": repr(exc)[:500]}
        if elapsed() < deadline:
            try:
                rec["end_to_end_at_same_settings"] = timed("end_to_end", chosen["n_iters"], chosen["cg"])
            except Exception as exc:
                rec["end_to_end_at_same_settings"] = {"error": repr(exc)[:500]}
        if match is None:
            rec["note"] = (f"no rung reached the target error {target_err:.2e}; at_equal_accuracy holds the most "
                           f"accurate rung (err {chosen['err_vs_exact']:.2e})")
    return rec


# -------------------------------------------------------------------------------------- e. OTT

def ott_section(x, y, v, h_ref, reps, threshold=1e-3) -> dict:
    try:
        from importlib import metadata

        metadata.version("ott-jax")
    except Exception:
        return {"skipped": "ott-jax not installed"}
    tmp = tempfile.mkdtemp(prefix="bench_hvp_ott_")
    fin, fout = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.json")
    np.savez(fin, x=x.cpu().numpy(), y=y.cpu().numpy(), v=v.cpu().numpy(), eps=EPS, reps=reps, threshold=threshold)
    env = dict(os.environ)
    if not CUDA:
        env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ott-child", fin, fout], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.perf_counter()
    start_slack = 120.0  # imports, the forward solve and its compilation
    timed_out = None
    while proc.poll() is None:
        time.sleep(0.5)
        now = time.perf_counter() - t0
        stage = None
        if os.path.exists(fout):
            try:
                with open(fout) as fh:
                    stage = json.load(fh)
            except Exception:
                stage = None
        st = stage.get("stage") if stage else "import"
        if st in ("import", "forward") and now > start_slack:
            timed_out = f"no first HVP call started within {start_slack:.0f} s (stage {st})"
        elif st == "first_call" and now > start_slack + OTT_FIRST_CALL_GUARD_S:
            timed_out = f"first HVP call (compile + run) took more than {OTT_FIRST_CALL_GUARD_S:.0f} s"
        elif st == "reps" and now > start_slack + OTT_FIRST_CALL_GUARD_S + (reps + 1) * stage.get("first_call_s", 60) + 60:
            timed_out = "timed reps ran past their budget"
        if timed_out:
            proc.kill()
            break
    out_text = proc.communicate()[0] or ""
    rec = {}
    if os.path.exists(fout):
        with open(fout) as fh:
            rec = json.load(fh)
    if timed_out:
        rec["timed_out"] = timed_out
    if proc.returncode not in (0, None) and not timed_out:
        rec["child_returncode"] = proc.returncode
    if "error" in rec or timed_out or proc.returncode:
        rec["child_output_tail"] = out_text[-2000:]
    hfile = fout + ".hvp.npy"
    if os.path.exists(hfile):
        h = torch.from_numpy(np.load(hfile)).to(DEV)
        rec["err_vs_exact"] = rel_err(h, h_ref)
    return rec


# ------------------------------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="n = m = 64, d = 4, one rep (CPU: Triton interpreter)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="seconds from the start after which the optional parts (ours at tighter thresholds, "
                         "neumann > 1) are skipped")
    ap.add_argument("--flash-budget-s", type=float, default=360.0, help="time for flash's accuracy ladder")
    ap.add_argument("--match", type=float, default=1.25, help="flash counts as equally accurate within this x ours")
    args = ap.parse_args()
    n, d = (64, 4) if args.smoke else (args.n, args.d)
    if args.smoke:
        args.budget_s = args.flash_budget_s = float("inf")  # exercise every path
    m = n
    reps_ours, reps_peer, warm = (1, 1, 0) if args.smoke else (5, 3, 1)
    notes = []
    payload = {"env": environment(), "workload": {
        "n": n, "m": m, "d": d, "eps": EPS, "scale_cost": 1.0, "weights": "uniform", "seed": args.seed,
        "data": "torch.manual_seed(seed); x = randn(n, d); y = randn(m, d); v = randn(n, d) (float32)",
        "conventions": "OTT: C = |x - y|^2 / scale_cost, eps absolute, loss = reg_ot_cost, HVP in x",
        "timing": ("CUDA events (torch, flash), wall clock + block_until_ready (JAX, OTT), median of reps after a "
                   "warm-up call; the forward solve is included in every time") if CUDA else
                  "CPU: wall clock, Triton interpreter (times meaningless)",
        "reps": {"ours": reps_ours, "peers": reps_peer}, "smoke": args.smoke}, "notes": notes}
    out_path = None

    def save():
        nonlocal out_path
        if args.smoke:
            out_path = os.path.join(tempfile.gettempdir(), f"hvp_vs_flash_smoke_{DEV}.json")
            with open(out_path, "w") as fh:
                json.dump(payload, fh, indent=1)
        else:
            out_path = write("hvp_vs_flash", payload)

    torch.manual_seed(args.seed)
    x = torch.randn(n, d, device=DEV)
    y = torch.randn(m, d, device=DEV)
    v = torch.randn(n, d, device=DEV)

    # f. reference + validation
    print(f"[{elapsed():6.1f}s] validating the float64 reference at n = m = 64, d = 4", flush=True)
    payload["validation"] = validate_reference(args.seed)
    print("  ", payload["validation"], flush=True)
    print(f"[{elapsed():6.1f}s] float64 reference at n = m = {n}, d = {d}", flush=True)
    ref, s = once_s(solve_potentials, x, y, EPS, threshold=1e-10, strict=False)
    if ref.marginal_error > 1e-10:
        notes.append(f"float64 reference stopped at L1 marginal error {ref.marginal_error:.1e} (target 1e-10)")
    (h_ref, _), s_hvp = once_s(hvp_reference, ref, vx=v)
    C = ref.C
    payload["reference"] = {"seconds_potentials": s, "seconds_hvp": s_hvp, "marginal_error_l1": ref.marginal_error, "threshold": 1e-10,
                            "warm_sinkhorn_iterations": ref.sinkhorn_iterations,
                            "newton_iterations": ref.newton_iterations, "hvp_norm": float(h_ref.norm()),
                            "method": "tests/hvp_reference_gpu.py (dense float64 on the device)"}
    # keep C (reused for the own-potentials splits); drop the rest of the reference
    ref.P = None
    ref._chol = None
    del ref
    free()
    print("  ", payload["reference"], flush=True)
    save()

    # a. ours torch, default options
    hvp = torch_hvp()
    print(f"[{elapsed():6.1f}s] ours torch (default options)", flush=True)
    box = {}
    t, ts = timer(lambda: box.__setitem__("out", hvp(x, y, v, epsilon=EPS)), reps_ours, warm)
    h, info = box["out"]
    ours = {"call": "torch_api.hvp(x, y, v, epsilon=0.1)", "ms": t, "all_ms": ts, **info_dict(info),
            "err_vs_exact": rel_err(h, h_ref)}
    box = {}
    t_fwd, ts_fwd = timer(lambda: box.__setitem__("out", torch_api.sinkhorn(x, y, epsilon=EPS)), reps_peer, warm)
    out = box["out"]
    ours["forward"] = {"call": "torch_api.sinkhorn(x, y, epsilon=0.1)", "ms": t_fwd, "all_ms": ts_fwd,
                       "n_iters": int(out.n_iters), "converged": bool(out.converged)}
    ours.update(own_split(x, y, v, out.f, out.g, C, h, h_ref))
    ours_iters = int(out.n_iters)
    del out, box
    if ours["err_f64_at_own_potentials_vs_exact"] > 10 * ours["err_vs_f64_at_own_potentials"]:
        notes.append(
            f"ours: the error against the converged float64 HVP ({ours['err_vs_exact']:.2e}) is the forward solve's: "
            f"the float64 HVP at our own float32 potentials (L1 marginal error {ours['marginal_error_l1']:.1e}, "
            f"threshold 1e-3) is {ours['err_f64_at_own_potentials_vs_exact']:.2e} from the exact one, while our HVP "
            f"is {ours['err_vs_f64_at_own_potentials']:.2e} from it (see ours_torch_threshold_ladder)")
    payload["ours_torch"] = ours
    print("  ", ours, flush=True)
    save()

    # b. preconditioners
    print(f"[{elapsed():6.1f}s] ours torch per preconditioner", flush=True)
    IO = torch_api.ImplicitOptions
    pre = {"none": {"same_as": "ours_torch (the default preconditioner is 'none')", "ms": ours["ms"],
                    "cg_iterations": ours["cg_iterations"], "cg_residual": ours["cg_residual"],
                    "err_vs_exact": ours["err_vs_exact"]}}
    for name, opts in (("jacobi", IO(preconditioner="jacobi")), ("neumann_1", IO(preconditioner="neumann", neumann_terms=1)),
                       ("neumann_2", IO(preconditioner="neumann", neumann_terms=2)),
                       ("neumann_3", IO(preconditioner="neumann", neumann_terms=3))):
        if name in ("neumann_2", "neumann_3"):
            n1 = pre.get("neumann_1", {}).get("ms")
            if n1 is None or (n1 > 2 * pre["none"].get("ms", 0.0) and not args.smoke) or elapsed() + (reps_ours + warm) * n1 / 1e3 > args.budget_s:
                pre[name] = {"skipped": "neumann_1 slow (> 2x none) or time budget"}
                continue
        try:
            box = {}
            t, ts = timer(lambda: box.__setitem__("out", hvp(x, y, v, epsilon=EPS, implicit=opts)), reps_ours, warm)
            hh, ii = box["out"]
            pre[name] = {"ms": t, "all_ms": ts, **info_dict(ii), "err_vs_exact": rel_err(hh, h_ref)}
        except Exception as exc:
            pre[name] = {"error": repr(exc)[:500]}
        print("  ", name, pre[name], flush=True)
    payload["ours_torch_preconditioners"] = pre
    save()

    # d. flash (before JAX: no JAX allocations on the device while torch peers run)
    print(f"[{elapsed():6.1f}s] flash-sinkhorn", flush=True)
    target = max(args.match * ours["err_vs_exact"], 1e-6)
    try:
        fl = flash_section(x, y, v, h_ref, C, target, ours_iters, reps_peer, elapsed() + args.flash_budget_s)
    except Exception as exc:
        fl = {"error": repr(exc)[:500], "traceback": traceback.format_exc()[-2000:]}
    if "at_equal_accuracy" in fl and "ms" in fl["at_equal_accuracy"]:
        fl["speedup_at_equal_accuracy"] = fl["at_equal_accuracy"]["ms"] / ours["ms"]
    if "default_alternating" in fl and "ms" in fl["default_alternating"]:
        fl["speedup_vs_flash_default"] = fl["default_alternating"]["ms"] / ours["ms"]
    payload["flash"] = fl
    print("  flash:", {k: fl[k] for k in fl if k not in ("ladder", "calls", "problem_mapping")}, flush=True)
    save()

    # c. ours JAX
    print(f"[{elapsed():6.1f}s] ours JAX", flush=True)
    try:
        import jax
        import jax.numpy as jnp

        import ot_triton_jax as otj

        if os.environ.get("TRITON_CACHE_DIR") == "":  # jax_triton 0.3.1 quirk (shared/gpu/README.md)
            del os.environ["TRITON_CACHE_DIR"]
        backend = jax.default_backend()
        if CUDA and backend != "gpu":
            raise RuntimeError(f"JAX has no GPU backend here ({backend}); not timed against torch on the GPU")
        xj, yj, vj = (jnp.asarray(t_.cpu().numpy()) for t_ in (x, y, v))
        box = {}

        def jx():
            hj, ij = otj.hvp(xj, yj, vj, epsilon=EPS)
            box["out"] = (hj.block_until_ready(), ij)

        t, ts = wall_median_ms(jx, reps=reps_ours, warmup=1 if CUDA else warm)
        hj, ij = box["out"]
        jrec = {"call": "ot_triton_jax.hvp(x, y, v, epsilon=0.1)", "jax_backend": backend, "ms": t, "all_ms": ts,
                "cg_iterations": int(ij.cg_iterations), "cg_residual": float(ij.cg_residual),
                "cg_converged": bool(ij.cg_converged), "solve_converged": bool(ij.solve_converged),
                "err_vs_exact": rel_err(torch.from_numpy(np.array(hj)).to(DEV), h_ref),
                "err_vs_torch": rel_err(torch.from_numpy(np.array(hj)).to(DEV), h.double())}
        jrec["jax_over_torch"] = t / ours["ms"]
        jrec["within_1.2x"] = jrec["jax_over_torch"] <= 1.2
        if not CUDA:
            jrec["note"] = "CPU: JAX timing includes the host callback path; ratio meaningless"
    except Exception as exc:
        jrec = {"error": repr(exc)[:800], "traceback": traceback.format_exc()[-2000:]}
    payload["ours_jax"] = jrec
    print("  ", {k: jrec[k] for k in jrec if k != "traceback"}, flush=True)
    save()

    # e. OTT-JAX
    print(f"[{elapsed():6.1f}s] OTT-JAX (child process)", flush=True)
    try:
        ott = ott_section(x, y, v, h_ref, reps_peer)
    except Exception as exc:
        ott = {"error": repr(exc)[:800]}
    if "ms" in ott:
        ott["speedup"] = ott["ms"] / ours["ms"]
    if "error" in ott:
        ott["summary"] = ott["error"].rsplit("Error: ", 1)[-1].split(". ")[0][:200]
    payload["ott"] = ott
    print("  ", {k: ott[k] for k in ott if k not in ("traceback", "child_output_tail")}, flush=True)
    # a'. ours at tighter forward thresholds (one call each; optional, within the time budget)
    print(f"[{elapsed():6.1f}s] ours torch at tighter forward thresholds", flush=True)
    ladder = []
    for thr in ((1e-4,) if args.smoke else (3e-4, 1e-4, 1e-5)):
        if elapsed() > args.budget_s:
            notes.append(f"ours threshold ladder stopped at {thr:g}: time budget")
            break
        try:
            (hh, ii), s = once_s(lambda: hvp(x, y, v, epsilon=EPS, threshold=thr, max_iterations=50000))
            row = {"threshold": thr, "max_iterations": 50000, "seconds_one_call": s, **info_dict(ii),
                   "err_vs_exact": rel_err(hh, h_ref)}
        except Exception as exc:
            row = {"threshold": thr, "error": repr(exc)[:500]}
        ladder.append(row)
        print("  ", row, flush=True)
        if row.get("seconds_one_call", 0) > 60:
            break
    payload["ours_torch_threshold_ladder"] = ladder
    save()

    payload["total_seconds"] = elapsed()
    save()

    # table
    print(f"\nwrote {out_path}")
    print(f"HVP in x, n = m = {n}, d = {d}, eps = {EPS} (forward solve included), device {payload['env']['device']}")
    print(f"{'method':<34} {'ms':>10} {'CG it':>6} {'err vs f64':>10} {'note'}")

    def row(name, r, note=""):
        r = r if isinstance(r, dict) else {}
        err = r.get("err_vs_exact", float("nan"))
        if "ms" not in r:
            why = (r.get("skipped") or r.get("timed_out") or r.get("skipped_reps") or r.get("summary")
                   or r.get("error") or "-")
            print(f"{name:<34} {'-':>10} {'-':>6} {err:>10.2e} {str(why)[:90]}")
            return
        print(f"{name:<34} {r['ms']:>10.2f} {r.get('cg_iterations', '-')!s:>6} {err:>10.2e} {note}")

    row("ours torch (default)", ours, f"fwd {ours['forward']['n_iters']} it, {ours['forward']['ms']:.1f} ms; "
        f"err at own potentials {ours['err_vs_f64_at_own_potentials']:.1e}")
    for r in ladder:
        rr = dict(r, ms=r["seconds_one_call"] * 1e3) if "seconds_one_call" in r else r
        row(f"ours torch threshold {r['threshold']:g} (1 call)", rr,
            f"solve converged {r.get('solve_converged')}")
    for k, r in pre.items():
        if k != "none":
            row(f"ours torch precond {k}", r)
    row("ours JAX", jrec, f"JAX/torch {jrec.get('jax_over_torch', float('nan')):.2f}")
    for k in ("default_alternating", "default_end_to_end", "at_equal_accuracy", "end_to_end_at_same_settings"):
        if k in fl:
            r = fl[k]
            row(f"flash {k}", r, f"N={r.get('n_iters')} cg={r.get('cg')}" if "ms" in r else "")
    if "skipped" in fl or "error" in fl:
        row("flash", fl)
    if "speedup_at_equal_accuracy" in fl:
        print(f"speedup flash / ours at equal accuracy: {fl['speedup_at_equal_accuracy']:.2f}x "
              f"(equal accuracy reached: {fl['equal_accuracy_reached']})")
    row("OTT-JAX jvp(grad), implicit", ott, f"speedup {ott['speedup']:.2f}x" if "speedup" in ott else "")
    v_ok = payload["validation"]["passed"]
    print(f"reference validation (n = 64): {'passed' if v_ok else 'FAILED'} {payload['validation']['checks']}")
    if not v_ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
