"""Float64 OTT-JAX reference for unbalanced (KL-relaxed) Sinkhorn quantities (tests only).

The OTT computation runs in a SUBPROCESS (``python tests/ott_unbalanced_reference.py IN.npz
OUT.npz``) with ``jax_enable_x64`` and ``JAX_PLATFORMS=cpu``: importing this module imports only
numpy and the stdlib, so neither float64 nor jax leaks into the calling test process.

Caller API::

    from ott_unbalanced_reference import ott_unbalanced_reference
    out = ott_unbalanced_reference(["f", "g", "cost", "grad_x", "div"], x=x, y=y, a=a, b=b,
                                   eps=0.3, tau_a=0.9, tau_b=1.0)

Problem (OTT-JAX 0.6.0 conventions, ``recenter_potentials=False``)::

    geom = PointCloud(x, y, epsilon=eps, scale_cost=scale_cost)     # C = |x - y|^2 / scale_cost
    out  = Sinkhorn(threshold=1e-12, max_iterations=20000, lse_mode=True)(
               LinearProblem(geom, a, b, tau_a, tau_b))
    (OTT's defaults otherwise: implicit_diff=ImplicitDiff(), hence use_danskin=True: the
    derivatives of reg_ot_cost hold the potentials fixed.)

Quantities (keys of the returned dict):
    "f", "g"                                   OTT's potentials (-inf where a == 0 / b == 0)
    "cost"                                     out.reg_ot_cost
    "grad_x", "grad_y", "grad_a", "grad_b"     jax.grad of reg_ot_cost (OTT's defaults: Danskin)
    "div", "div_grad_x", "div_grad_y"          sinkhorn_divergence(PointCloud, x, y, a=a, b=b,
                                               epsilon=eps, scale_cost=scale_cost,
                                               solve_kwargs=dict(<solver>, tau_a=, tau_b=))[0]
                                               and its gradients in x, y
Always returned: "n_iters", "converged" (1.0).

Zero weights: OTT's derivatives in the weights are NaN at zero weights, so the problem is solved on the support (zero-weight points removed: the same problem, since they
carry no mass in any term) and scattered back: f, g = -inf, rows of x / y derivatives = 0,
entries of a / b derivatives = NaN at zero-weight points.

Errors: the subprocess raises (RuntimeError here) if a solve did not converge or a requested
value is not finite. XLA cache: $OTT_REFERENCE_JAX_CACHE (as tests/ott_reference.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np

__all__ = ["ott_unbalanced_reference", "KNOWN_QUANTITIES"]

_THIS = os.path.abspath(__file__)
_LAYOUT = {"cost": (), "div": (), "f": "f", "g": "g", "grad_x": "x", "div_grad_x": "x",
           "grad_y": "y", "div_grad_y": "y", "grad_a": "a", "grad_b": "b"}
KNOWN_QUANTITIES = tuple(sorted(_LAYOUT))


def ott_unbalanced_reference(quantities, *, x, y, a=None, b=None, eps, tau_a=1.0, tau_b=1.0,
                             scale_cost=1.0, threshold=1e-12, max_iterations=20000,
                             timeout: float = 900.0) -> dict:
    """Compute ``quantities`` with OTT-JAX in float64 in a subprocess (module docstring).
    Arrays may be numpy, jax or torch; returns {name: float64 numpy array}."""
    if isinstance(quantities, str):
        quantities = [quantities]
    unknown = [q for q in quantities if q not in KNOWN_QUANTITIES]
    if unknown:
        raise ValueError(f"unknown quantities {unknown}; known: {KNOWN_QUANTITIES}")

    def arr(v):
        if hasattr(v, "detach"):
            v = v.detach().cpu().numpy()
        return np.asarray(v, dtype=np.float64)

    x, y = arr(x), arr(y)
    a = np.full(x.shape[0], 1.0 / x.shape[0]) if a is None else arr(a)
    b = np.full(y.shape[0], 1.0 / y.shape[0]) if b is None else arr(b)
    payload = dict(x=x, y=y, a=a, b=b, eps=arr(eps), tau_a=arr(tau_a), tau_b=arr(tau_b),
                   scale_cost=arr(scale_cost), threshold=arr(threshold),
                   max_iterations=arr(max_iterations),
                   __quantities__=np.array(list(quantities), dtype=np.str_))
    with tempfile.TemporaryDirectory(prefix="ott_unb_ref_") as tmp:
        fin, fout = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        np.savez(fin, **payload)
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1")
        proc = subprocess.run([sys.executable, _THIS, fin, fout], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(fout):
            raise RuntimeError(f"ott_unbalanced_reference subprocess failed (rc={proc.returncode}) "
                               f"for {list(quantities)}:\n{proc.stderr[-8000:]}")
        with np.load(fout) as z:
            return {k: np.asarray(z[k], dtype=np.float64) for k in z.files}


# ----------------------------------------------------------------------------------------
# Subprocess side (jax / ott are imported only here).
# ----------------------------------------------------------------------------------------

def _compute(inp: dict, q: set) -> dict:
    import jax
    import jax.numpy as jnp
    from ott.geometry import pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn
    from ott.tools import sinkhorn_divergence as sd

    x, y, a, b = (jnp.asarray(inp[k]) for k in ("x", "y", "a", "b"))
    eps, sc = float(inp["eps"]), float(inp["scale_cost"])
    tau_a, tau_b = float(inp["tau_a"]), float(inp["tau_b"])
    # OTT's defaults otherwise: implicit_diff=ImplicitDiff() and so use_danskin=True (the potentials
    # are held fixed in the derivatives of reg_ot_cost)
    solve_kwargs = dict(threshold=float(inp["threshold"]), max_iterations=int(inp["max_iterations"]),
                        lse_mode=True)
    solver = sinkhorn.Sinkhorn(**solve_kwargs)

    def solve(x, y, a, b):
        geom = pointcloud.PointCloud(x, y, epsilon=eps, scale_cost=sc)
        return solver(linear_problem.LinearProblem(geom, a, b, tau_a=tau_a, tau_b=tau_b))

    res = {}
    out = jax.jit(solve)(x, y, a, b)
    if not bool(out.converged):
        raise RuntimeError(f"OTT Sinkhorn did not converge (errors {np.asarray(out.errors)[-3:]})")
    res.update(n_iters=out.n_iters, converged=1.0, f=out.f, g=out.g, cost=out.reg_ot_cost)
    if q & {"grad_x", "grad_y", "grad_a", "grad_b"}:
        grads = jax.jit(jax.grad(lambda *v: solve(*v).reg_ot_cost, argnums=(0, 1, 2, 3)))(x, y, a, b)
        res.update(zip(("grad_x", "grad_y", "grad_a", "grad_b"), grads))
    if q & {"div", "div_grad_x", "div_grad_y"}:
        def div_out(x, y, a, b):
            return sd.sinkhorn_divergence(pointcloud.PointCloud, x, y, a=a, b=b, epsilon=eps,
                                          scale_cost=sc, solve_kwargs=dict(solve_kwargs, tau_a=tau_a,
                                                                           tau_b=tau_b))
        dval, dout = jax.jit(div_out)(x, y, a, b)
        if not all(bool(c) for c in dout.converged):
            raise RuntimeError(f"OTT sinkhorn_divergence did not converge: {dout.converged}")
        res["div"] = dval
        if q & {"div_grad_x", "div_grad_y"}:
            gd = jax.jit(jax.grad(lambda *v: div_out(*v)[0], argnums=(0, 1)))(x, y, a, b)
            res["div_grad_x"], res["div_grad_y"] = gd
    return {k: np.asarray(v, dtype=np.float64) for k, v in res.items()}


def _main(fin: str, fout: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("EQX_ON_ERROR", "nan")
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_disable_most_optimizations", True)
    cache = os.environ.get("OTT_REFERENCE_JAX_CACHE", "")
    if cache != "0":
        jax.config.update("jax_compilation_cache_dir",
                          cache or os.path.join(tempfile.gettempdir(), "ott_reference_jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    with np.load(fin) as z:
        inp = {k: z[k] for k in z.files}
    q = {str(s) for s in np.atleast_1d(inp.pop("__quantities__")).tolist()}
    a, b = inp["a"], inp["b"]
    sa, sb = a > 0, b > 0
    sub = dict(inp, x=inp["x"][sa], y=inp["y"][sb], a=a[sa], b=b[sb])
    res = _compute(sub, q)
    fills = {"f": (sa, -np.inf), "g": (sb, -np.inf), "x": (sa, 0.0), "y": (sb, 0.0),
             "a": (sa, np.nan), "b": (sb, np.nan)}
    for k, v in list(res.items()):
        kind = _LAYOUT.get(k, ())
        if kind:
            mask, fill = fills[kind]
            full = np.full((mask.size,) + v.shape[1:], fill)
            full[mask] = v
            res[k] = full
        elif k in q and not np.all(np.isfinite(v)):
            raise RuntimeError(f"non-finite {k}: {v}")
    for k in q & set(_LAYOUT):
        if _LAYOUT[k] and not np.all(np.isfinite(res[k][(sa if _LAYOUT[k] in "fxa" else sb)])):
            raise RuntimeError(f"non-finite {k} on the support")
    np.savez(fout, **res)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
