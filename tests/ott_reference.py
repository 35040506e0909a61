"""Float64 OTT-JAX reference for first- and second-order Sinkhorn quantities (tests only).

The OTT computation runs in a SUBPROCESS (``python tests/ott_reference.py IN.npz OUT.npz``)
with ``jax_enable_x64`` and ``JAX_PLATFORMS=cpu``, so float64 (or jax itself) never leaks
into the calling test process: importing this module imports only numpy and the stdlib.

CLI: ``python tests/ott_reference.py IN.npz OUT.npz``: IN.npz holds the arrays below plus
``__quantities__`` (array of str) and optionally ``__zero_weights__`` (str); OUT.npz receives
the results (at least the requested keys).

Caller API::

    from tests.ott_reference import ott_reference   # or: from ott_reference import ...
    out = ott_reference(["cost", "grad_x", "hvp_x"], x=x, y=y, a=a, b=b,
                        eps=0.3, scale_cost=1.0, vx=vx)
    out["hvp_x"]          # float64 numpy array, shape (n, d)

One call computes several quantities (the cost is ~2 s start-up plus a few seconds of XLA
compilation per quantity; group the quantities of a test in one call).

Problem (balanced, OTT conventions)::

    geom = PointCloud(x, y, epsilon=eps, scale_cost=scale_cost)     # C = |x - y|^2 / scale_cost
    out  = Sinkhorn(threshold=1e-12, max_iterations=20000, lse_mode=True, use_danskin=False,
                    implicit_diff=ImplicitDiff(solver_kwargs=dict(rtol=1e-13, atol=1e-13,
                                                                  max_steps=...)))(
               LinearProblem(geom, a, b))
    L(x, y, a, b) = out.reg_ot_cost
                  = sum a (f - eps log a) + sum b (g - eps log b) + eps (sum a sum b - sum P)

Derivatives are OTT's implicit ones (custom_vjp through ImplicitDiff; second order is
forward-over-reverse: JVP of the implicit backward pass, with the potentials' tangents
from forward-mode through the converged Sinkhorn loop). Validated against a dense
independent implicit-function-theorem HVP (~1e-12 rel.) and 4th-order finite differences.

Inputs (keyword arrays, converted to float64):
    x (n,d), y (m,d), a (n,), b (m,) [default uniform], eps, scale_cost [default 1.0];
    directions as needed: vx (n,d), vy (m,d), da (n,), wf (n,), wg (m,),
    vapply (m,) or (m,k), u (n,) or (n,k).
    Unbalanced (OTT's KL-relaxed marginals): tau_a [1.0], tau_b [1.0], passed to
    LinearProblem(geom, a, b, tau_a, tau_b) and to sinkhorn_divergence's solves.
    Label cost: label_x (n,), label_y (m,) integer classes and label_cost W (K_x, K_y): the
    geometry is then Geometry(cost_matrix=(|x_i - y_j|^2 + W[label_x_i, label_y_j]) / scale_cost)
    (dense; derivatives in x, y through the cost matrix; not for the divergence).
    use_danskin [0]: 1 runs OTT's DEFAULT Sinkhorn(use_danskin=None -> True with implicit_diff):
    reg_ot_cost's derivatives at fixed potentials. Same first derivatives as 0 for balanced
    problems (the dual objective is stationary there), NOT for tau < 1 (OTT's relaxed
    reg_ot_cost is not stationary at the fixed point of its updates): compare the first
    derivatives of an unbalanced problem with OTT's defaults using use_danskin=1.
    Optional solver scalars: threshold [1e-12] (OTT's error: ||P^T 1 - b||_1, every 10
    iterations), max_iterations [20000], lin_rtol [1e-13], lin_atol [1e-13],
    lin_max_steps [20000] (lineax CG / NormalCG of the implicit solve).
Option (keyword, not an array): zero_weights = "support" (default) or "ott", see below.

Quantities (keys of the returned dict):
    "cost"          L
    "f", "g"        OTT's potentials (-inf where a == 0 / b == 0). OTT's gauge: no
                    recentering (Sinkhorn default recenter_potentials=False): the limit of the
                    alternating (g then f) LSE updates started from f = 0.
    "grad_x", "grad_y", "grad_a", "grad_b"
                    jax.grad of L. OTT's grad_a == f - eps*log(a), grad_b == g - eps*log(b)
                    (same gauge as f, g; only (grad_a + c, grad_b - c) classes are meaningful
                    in the balanced problem: compare after removing that constant).
    "hvp_x"         jax.jvp(jax.grad(L, x), (x,), (vx,))[1]                       (n,d)
    "hvp_y"         same in y with vy                                             (m,d)
    "hvp_xy_joint"  -> "hvp_joint_x" (n,d), "hvp_joint_y" (m,d): JVP of (grad_x, grad_y) in
                    the joint direction (vx, vy)
    "hvp_env_x", "hvp_env_y"
                    JVP (direction vx, resp. vy) of the gradient of the dual value
                    V = sum_{a>0} a phi_a(f) + sum_{b>0} b phi_b(g) - eps sum P at OTT's solution,
                    phi(h) = h (tau = 1) or -rho (exp(-h/rho) - 1) (rho = eps tau/(1 - tau)).
                    V is stationary at the fixed point of OTT's updates (P 1 = a e^{-f/rho_a}),
                    so its gradient in x, y is the envelope 2s(r x - P y) = OTT's DEFAULT
                    (use_danskin) gradient of reg_ot_cost, and these are that gradient's
                    derivatives with the potentials moving. Equal to hvp_x / hvp_y when
                    tau_a = tau_b = 1; for tau < 1 hvp_x differentiates reg_ot_cost's own
                    (not stationary) potential dependence instead.
    "div_hvp_env_x", "div_hvp_env_y"
                    the same for the divergence V(x, y) - 1/2 V(x, x) - 1/2 V(y, y) (each V at
                    OTT's solution of LinearProblem(., ., w1, w2, tau_a, tau_b); the self
                    problems' fixed points do not depend on the update order).
    "hess_xx"       jax.hessian(L, x)                                             (n,d,n,d)
    "hess_aa"       Hessian in a on the balanced tangent space: Pn H Pn, Pn = I - 1 1^T/n
                    (double-centred, symmetric)                                   (n,n)
    "hess_aa_raw"   jax.hessian(L, a) as OTT returns it. NOT meaningful off the zero-sum
                    subspace (non-zero-sum tangents drift with the iteration count: rows sum
                    to ~1e2); OTT's own test_hessian_sinkhorn subtracts row means (= H Pn).
    "hess_ax"       d(grad_x)/da in zero-sum directions: [..., j] = JVP of grad_x in
                    direction e_j - 1/n, i.e. (d grad_x/da) @ Pn                  (n,d,n)
    "hvp_a"         Pn @ JVP of grad_a in direction Pn @ da (== hess_aa @ da)     (n,)
    "hvp_a_raw"     JVP of grad_a in direction da as given (defined up to + c 1 only)
    "div", "div_grad_x", "div_grad_y", "div_hvp_x", "div_hvp_y"
                    OTT's debiased Sinkhorn divergence
                    sinkhorn_divergence(PointCloud, x, y, a=a, b=b, epsilon=eps,
                    scale_cost=scale_cost, static_b=False, solve_kwargs=<solver settings>)
                    [0], its gradients and its HVPs (directions vx / vy). OTT solves the
                    (x,x), (y,y) terms with parallel_dual_updates + momentum 0.5; all three
                    solves are checked for convergence.
    "pot_vjp"       -> "pot_vjp_x", "pot_vjp_y", "pot_vjp_a", "pot_vjp_b": gradients of
                    phi = sum_{a>0} wf f + sum_{b>0} wg g (implicit diff of the potentials).
                    Pass sum(wf) == sum(wg) (gauge invariance); pot_vjp_a / _b are then
                    defined up to (+c, -c) as for grad_a / grad_b.
    "apply"         -> "apply_value" = out.apply(vapply, axis=1) = P @ vapply: (n,) or (n,k).
                    (OTT: axis=1 multiplies P by a length-m vector, axis=0 gives P^T @ vec;
                    OTT batches as (k, m), so vapply.T is passed and the result transposed.)
                    and "apply_vjp_x", "apply_vjp_y", "apply_vjp_a", "apply_vjp_b":
                    gradients of sum(apply_value * u).
    Sub-keys ("hvp_joint_x", "pot_vjp_x", "apply_value", ...) may also be requested directly.
Always returned: "n_iters" (Sinkhorn iterations of the main solve), "converged" (1.0).

Zero weights (a_i == 0 or b_j == 0):
    OTT's implicit differentiation with use_danskin=False gives NaN for EVERY entry of every
    derivative (NaN from the -inf potentials spreads through the implicit linear solve; with
    use_danskin=True or unrolling, grad_x is finite). So by default (zero_weights="support")
    the problem is solved by OTT on the support (zero-weight points removed: this is the same
    OT problem, cost / f / g on the support agree with OTT's full solve) and results are
    scattered back with: f, g = -inf at zero weights (OTT's forward convention); derivatives
    in x / y (rows of grad_x, hvp_*, hess_xx, div_*, pot_vjp_x, apply_vjp_x, ...) = 0 at
    zero-weight points (L does not depend on them); derivatives in a / b at zero-weight entries
    = NaN (OTT's documented convention for the weights); apply_value = 0 on zero rows.
    Pn-centring (hess_aa, hess_ax, hvp_a) is then over the support (da is restricted to the
    support and centred there). zero_weights="ott" returns OTT's raw full-problem output.

Errors: the subprocess raises (-> RuntimeError here) if a Sinkhorn solve did not converge or
if a computed value is non-finite (lineax errors are turned into NaN, EQX_ON_ERROR=nan, so
that the XLA persistent cache can be used; the finiteness check catches them). The check is
skipped only for zero_weights="ott" with zero weights.
XLA cache: $OTT_REFERENCE_JAX_CACHE (default <tmpdir>/ott_reference_jax_cache; "0" = off).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np

__all__ = ["ott_reference", "KNOWN_QUANTITIES"]

_THIS = os.path.abspath(__file__)

_GROUPS = {
    "hvp_xy_joint": ("hvp_joint_x", "hvp_joint_y"),
    "pot_vjp": ("pot_vjp_x", "pot_vjp_y", "pot_vjp_a", "pot_vjp_b"),
    "apply": ("apply_value", "apply_vjp_x", "apply_vjp_y", "apply_vjp_a", "apply_vjp_b"),
}

# Per output key: the index kind of each leading axis ("x": rows of x / entries of a as a
# point index, fill 0 off the support; "a": entries of a as a weight index, fill NaN;
# likewise "y" / "b"; None: a feature axis) and the fill for "f" / "g".
_LAYOUT = {
    "cost": (), "div": (), "n_iters": (), "converged": (),
    "f": ("f",), "g": ("g",),
    "grad_a": ("a",), "hvp_a": ("a",), "hvp_a_raw": ("a",), "pot_vjp_a": ("a",),
    "apply_vjp_a": ("a",), "grad_b": ("b",), "pot_vjp_b": ("b",), "apply_vjp_b": ("b",),
    "hess_aa": ("a", "a"), "hess_aa_raw": ("a", "a"),
    "hess_xx": ("x", None, "x", None), "hess_ax": ("x", None, "a"),
    "apply_value": ("x",),
}
for _k in ("grad_x", "hvp_x", "hvp_env_x", "div_hvp_env_x", "hvp_joint_x", "div_grad_x", "div_hvp_x", "pot_vjp_x",
           "apply_vjp_x"):
    _LAYOUT[_k] = ("x",)
for _k in ("grad_y", "hvp_y", "hvp_env_y", "div_hvp_env_y", "hvp_joint_y", "div_grad_y", "div_hvp_y", "pot_vjp_y",
           "apply_vjp_y"):
    _LAYOUT[_k] = ("y",)

KNOWN_QUANTITIES = tuple(sorted(set(_LAYOUT) | set(_GROUPS)))


def ott_reference(quantities, *, zero_weights: str = "support", timeout: float = 900.0,
                  **arrays) -> dict:
    """Compute ``quantities`` with OTT-JAX in float64 in a subprocess (see module docstring).

    ``arrays``: numpy-convertible values (torch tensors are detached and moved to CPU).
    Returns {name: float64 numpy array}. Raises RuntimeError carrying the subprocess's
    stderr on failure (non-convergence included).
    """
    if isinstance(quantities, str):
        quantities = [quantities]
    quantities = [str(q) for q in quantities]
    unknown = [q for q in quantities if q not in KNOWN_QUANTITIES]
    if unknown:
        raise ValueError(f"unknown quantities {unknown}; known: {KNOWN_QUANTITIES}")
    if zero_weights not in ("support", "ott"):
        raise ValueError("zero_weights must be 'support' or 'ott'")
    payload = {}
    for k, v in arrays.items():
        if v is None:
            continue
        if hasattr(v, "detach"):  # torch tensor
            v = v.detach().cpu().numpy()
        payload[k] = np.asarray(v, dtype=np.float64)
    payload["__quantities__"] = np.array(quantities, dtype=np.str_)
    payload["__zero_weights__"] = np.array(zero_weights, dtype=np.str_)
    with tempfile.TemporaryDirectory(prefix="ott_ref_") as tmp:
        fin, fout = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        np.savez(fin, **payload)
        env = dict(os.environ)
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_ENABLE_X64"] = "1"
        proc = subprocess.run(
            [sys.executable, _THIS, fin, fout],
            env=env, capture_output=True, text=True, timeout=timeout,
        )
        if proc.returncode != 0 or not os.path.exists(fout):
            raise RuntimeError(
                f"ott_reference subprocess failed (rc={proc.returncode}) for {quantities}:\n"
                f"{proc.stderr[-8000:]}"
            )
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
    from ott.solvers.linear import implicit_differentiation as implicit_lib
    from ott.solvers.linear import sinkhorn
    from ott.tools import sinkhorn_divergence as sd

    x, y, a, b = (jnp.asarray(inp[k]) for k in ("x", "y", "a", "b"))
    n = x.shape[0]
    eps = float(inp["eps"])
    scale_cost = float(inp.get("scale_cost", 1.0))
    threshold = float(inp.get("threshold", 1e-12))
    taus = dict(tau_a=float(inp.get("tau_a", 1.0)), tau_b=float(inp.get("tau_b", 1.0)))
    max_iterations = int(inp.get("max_iterations", 20000))
    lin_kwargs = dict(
        rtol=float(inp.get("lin_rtol", 1e-13)),
        atol=float(inp.get("lin_atol", 1e-13)),
        max_steps=int(inp.get("lin_max_steps", 20000)),
    )

    def need(name):
        if name not in inp:
            raise ValueError(f"the requested quantities need input {name!r}")
        return jnp.asarray(inp[name])

    solve_kwargs = dict(
        threshold=threshold,
        max_iterations=max_iterations,
        lse_mode=True,
        use_danskin=bool(float(inp.get("use_danskin", 0.0))),
        implicit_diff=implicit_lib.ImplicitDiff(solver_kwargs=lin_kwargs),
    )
    solver = sinkhorn.Sinkhorn(**solve_kwargs)

    if "label_cost" in inp:  # label cost: a dense geometry of |x - y|^2 + W[lx, ly], over scale_cost
        from ott.geometry import geometry

        lab_w = jnp.asarray(inp["label_cost"])[jnp.asarray(inp["label_x"]).astype(int)][
            :, jnp.asarray(inp["label_y"]).astype(int)]

        def make_geom(x, y):
            sq = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
            return geometry.Geometry(cost_matrix=(sq + lab_w) / scale_cost, epsilon=eps)
    else:
        def make_geom(x, y):
            return pointcloud.PointCloud(x, y, epsilon=eps, scale_cost=scale_cost)

    def solve(x, y, a, b):
        return solver(linear_problem.LinearProblem(make_geom(x, y), a, b, **taus))

    def L(x, y, a, b):
        return solve(x, y, a, b).reg_ot_cost

    def div_out(x, y, a, b):
        return sd.sinkhorn_divergence(
            pointcloud.PointCloud, x, y, a=a, b=b, epsilon=eps, scale_cost=scale_cost,
            static_b=False, solve_kwargs=dict(solve_kwargs, **taus),
        )

    D = lambda x, y, a, b: div_out(x, y, a, b)[0]
    # All data are jit arguments (not closure constants) so that the persistent XLA cache
    # hits across calls with the same shapes.
    jit = jax.jit
    res = {}

    out = jit(solve)(x, y, a, b)
    if not bool(out.converged):
        errs = np.asarray(out.errors)
        last = errs[errs >= 0][-1] if np.any(errs >= 0) else np.nan
        raise RuntimeError(
            f"OTT Sinkhorn did not converge: threshold={threshold}, "
            f"max_iterations={max_iterations}, last recorded error={last}"
        )
    res["n_iters"] = out.n_iters
    res["converged"] = 1.0
    for k, v in (("cost", out.reg_ot_cost), ("f", out.f), ("g", out.g)):
        if k in q:
            res[k] = v

    gL = jax.grad(L, argnums=(0, 1, 2, 3))
    grad_keys = ("grad_x", "grad_y", "grad_a", "grad_b")
    grads = None  # the primal of an HVP's jvp is the gradient: reuse it (one compile less)

    if "hvp_x" in q:
        f_ = lambda x, y, a, b, vx: jax.jvp(lambda t: gL(t, y, a, b), (x,), (vx,))
        grads, tang = jit(f_)(x, y, a, b, need("vx"))
        res["hvp_x"] = tang[0]
    if "hvp_y" in q:
        f_ = lambda x, y, a, b, vy: jax.jvp(lambda t: gL(x, t, a, b), (y,), (vy,))
        grads, tang = jit(f_)(x, y, a, b, need("vy"))
        res["hvp_y"] = tang[1]
    if q & {"hvp_joint_x", "hvp_joint_y"}:
        def f_(x, y, a, b, vx, vy):
            return jax.jvp(lambda s, t: gL(s, t, a, b), (x, y), (vx, vy))
        grads, tang = jit(f_)(x, y, a, b, need("vx"), need("vy"))
        res["hvp_joint_x"], res["hvp_joint_y"] = tang[:2]
    if q & set(grad_keys):
        if grads is None:
            grads = jit(gL)(x, y, a, b)
        res.update(zip(grad_keys, grads))
    if q & {"hvp_env_x", "hvp_env_y", "div_hvp_env_x", "div_hvp_env_y"}:
        def V(x, y, a, b):
            o = solve(x, y, a, b)
            C = pointcloud.PointCloud(x, y, epsilon=eps, scale_cost=scale_cost).cost_matrix
            total = jnp.sum(jnp.exp((o.f[:, None] + o.g[None, :] - C) / eps))

            def term(w, h, tau):
                h = jnp.where(w > 0, h, 0.0)
                if tau == 1.0:
                    return jnp.sum(jnp.where(w > 0, w * h, 0.0))
                rho = eps * tau / (1.0 - tau)
                return -rho * jnp.sum(jnp.where(w > 0, w * (jnp.exp(-h / rho) - 1.0), 0.0))
            return term(a, o.f, taus["tau_a"]) + term(b, o.g, taus["tau_b"]) - eps * total
        gV = jax.grad(V, argnums=(0, 1))
        dV = lambda x, y, a, b: V(x, y, a, b) - 0.5 * V(x, x, a, a) - 0.5 * V(y, y, b, b)
        gD = jax.grad(dV, argnums=(0, 1))
        if "div_hvp_env_x" in q:
            f_ = lambda x, y, a, b, vx: jax.jvp(lambda t: gD(t, y, a, b), (x,), (vx,))[1][0]
            res["div_hvp_env_x"] = jit(f_)(x, y, a, b, need("vx"))
        if "div_hvp_env_y" in q:
            f_ = lambda x, y, a, b, vy: jax.jvp(lambda t: gD(x, t, a, b), (y,), (vy,))[1][1]
            res["div_hvp_env_y"] = jit(f_)(x, y, a, b, need("vy"))
        if "hvp_env_x" in q:
            f_ = lambda x, y, a, b, vx: jax.jvp(lambda t: gV(t, y, a, b), (x,), (vx,))[1][0]
            res["hvp_env_x"] = jit(f_)(x, y, a, b, need("vx"))
        if "hvp_env_y" in q:
            f_ = lambda x, y, a, b, vy: jax.jvp(lambda t: gV(x, t, a, b), (y,), (vy,))[1][1]
            res["hvp_env_y"] = jit(f_)(x, y, a, b, need("vy"))
    if "hess_xx" in q:
        res["hess_xx"] = jit(jax.hessian(L, argnums=0))(x, y, a, b)

    Pn = jnp.eye(n) - jnp.full((n, n), 1.0 / n)
    if q & {"hess_aa", "hess_aa_raw"}:
        H = jit(jax.hessian(L, argnums=2))(x, y, a, b)
        res["hess_aa_raw"] = H
        res["hess_aa"] = Pn @ H @ Pn
    if "hess_ax" in q:
        def f_(x, y, a, b, Pn):  # JVPs of grad_x in the zero-sum directions e_j - 1/n
            jv = lambda d: jax.jvp(lambda t: gL(x, y, t, b)[0], (a,), (d,))[1]
            return jnp.moveaxis(jax.vmap(jv)(Pn), 0, -1)
        res["hess_ax"] = jit(f_)(x, y, a, b, Pn)
    if q & {"hvp_a", "hvp_a_raw"}:
        f_ = jit(lambda x, y, a, b, d: jax.jvp(lambda t: gL(x, y, t, b)[2], (a,), (d,))[1])
        da = need("da")
        if "hvp_a_raw" in q:
            res["hvp_a_raw"] = f_(x, y, a, b, da)
        if "hvp_a" in q:
            res["hvp_a"] = Pn @ f_(x, y, a, b, Pn @ da)

    if q & {"div", "div_grad_x", "div_grad_y", "div_hvp_x", "div_hvp_y"}:
        dval, dout = jit(div_out)(x, y, a, b)
        conv = [bool(c) for c in dout.converged]
        if not all(conv):
            raise RuntimeError(f"OTT sinkhorn_divergence: solves (xy, xx, yy) converged={conv}")
        res["div"] = dval
        gD = jax.grad(D, argnums=(0, 1))
        if q & {"div_grad_x", "div_grad_y"}:
            res["div_grad_x"], res["div_grad_y"] = jit(gD)(x, y, a, b)
        if "div_hvp_x" in q:
            f_ = lambda x, y, a, b, vx: jax.jvp(lambda t: gD(t, y, a, b)[0], (x,), (vx,))[1]
            res["div_hvp_x"] = jit(f_)(x, y, a, b, need("vx"))
        if "div_hvp_y" in q:
            f_ = lambda x, y, a, b, vy: jax.jvp(lambda t: gD(x, t, a, b)[1], (y,), (vy,))[1]
            res["div_hvp_y"] = jit(f_)(x, y, a, b, need("vy"))

    if q & {"pot_vjp_x", "pot_vjp_y", "pot_vjp_a", "pot_vjp_b"}:
        def phi(x, y, a, b, wf, wg):
            o = solve(x, y, a, b)
            pf = jnp.where(a > 0, wf * jnp.where(a > 0, o.f, 0.0), 0.0)
            pg = jnp.where(b > 0, wg * jnp.where(b > 0, o.g, 0.0), 0.0)
            return jnp.sum(pf) + jnp.sum(pg)
        p4 = jit(jax.grad(phi, argnums=(0, 1, 2, 3)))(x, y, a, b, need("wf"), need("wg"))
        res.update(zip(("pot_vjp_x", "pot_vjp_y", "pot_vjp_a", "pot_vjp_b"), p4))

    if q & {"apply_value", "apply_vjp_x", "apply_vjp_y", "apply_vjp_a", "apply_vjp_b"}:
        def apply_fn(x, y, a, b, v):
            o = solve(x, y, a, b)
            if v.ndim == 1:
                return o.apply(v, axis=1)            # P @ v: (n,)
            return o.apply(v.T, axis=1).T            # P @ V: (n, k)
        vap = need("vapply")
        res["apply_value"] = jit(apply_fn)(x, y, a, b, vap)
        if q & {"apply_vjp_x", "apply_vjp_y", "apply_vjp_a", "apply_vjp_b"}:
            obj = lambda x, y, a, b, v, u: jnp.sum(apply_fn(x, y, a, b, v) * u)
            g4 = jit(jax.grad(obj, argnums=(0, 1, 2, 3)))(x, y, a, b, vap, need("u"))
            res.update(zip(("apply_vjp_x", "apply_vjp_y", "apply_vjp_a", "apply_vjp_b"), g4))

    return {k: np.asarray(v, dtype=np.float64) for k, v in res.items()}


def _scatter(val: np.ndarray, layout, sa: np.ndarray, sb: np.ndarray) -> np.ndarray:
    """Put a support-computed value back into full size (see module docstring)."""
    if not layout:
        return val
    kinds = [k for k in layout]
    shape, index = [], []
    for ax, kind in enumerate(kinds):
        if kind in ("x", "a", "f"):
            shape.append(sa.size), index.append(np.nonzero(sa)[0])
        elif kind in ("y", "b", "g"):
            shape.append(sb.size), index.append(np.nonzero(sb)[0])
        else:
            shape.append(val.shape[ax]), index.append(np.arange(val.shape[ax]))
    shape += list(val.shape[len(kinds):])
    fill = 0.0
    if kinds[0] in ("f", "g"):
        fill = -np.inf
    full = np.full(shape, fill)
    full[np.ix_(*index)] = val
    for ax, kind in enumerate(kinds):  # weight-index axes: NaN off the support
        if kind in ("a", "b"):
            supp = sa if kind == "a" else sb
            sl = [slice(None)] * full.ndim
            sl[ax] = ~supp
            full[tuple(sl)] = np.nan
    return full


def _main(fin: str, fout: str) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("EQX_ON_ERROR", "nan")  # no host callbacks -> cacheable executables
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_platforms", "cpu")
    # Tiny problems: XLA compile time dominates; unoptimized compiles are ~2x faster.
    jax.config.update("jax_disable_most_optimizations", True)
    cache = os.environ.get("OTT_REFERENCE_JAX_CACHE", "")
    if cache != "0":
        cache = cache or os.path.join(tempfile.gettempdir(), "ott_reference_jax_cache")
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    with np.load(fin) as z:
        inp = {k: z[k] for k in z.files}
    quantities = [str(s) for s in np.atleast_1d(inp.pop("__quantities__")).tolist()]
    zero_weights = str(inp.pop("__zero_weights__", np.array("support")))
    q = set(quantities)
    for grp, keys in _GROUPS.items():
        if grp in q:
            q |= set(keys)
    q -= set(_GROUPS)

    n, m = inp["x"].shape[0], inp["y"].shape[0]
    inp.setdefault("a", np.full(n, 1.0 / n))
    inp.setdefault("b", np.full(m, 1.0 / m))
    sa, sb = inp["a"] > 0, inp["b"] > 0
    has_zero = not (sa.all() and sb.all())

    if has_zero and zero_weights == "support":
        sub = dict(inp)
        for k in ("x", "a", "vx", "wf", "u", "label_x"):
            if k in sub:
                sub[k] = sub[k][sa]
        for k in ("y", "b", "vy", "wg", "vapply", "label_y"):
            if k in sub:
                sub[k] = sub[k][sb]
        if "da" in sub:  # zero-weight entries cannot move (weights stay >= 0)
            sub["da"] = sub["da"][sa]
        res = _compute(sub, q)
        _check_finite(res)
        res = {k: _scatter(v, _LAYOUT[k], sa, sb) for k, v in res.items()}
    else:
        res = _compute(inp, q)
        if not has_zero:
            _check_finite(res)
    np.savez(fout, **res)


def _check_finite(res: dict) -> None:
    for k, v in res.items():
        if not np.all(np.isfinite(v)):
            raise RuntimeError(
                f"non-finite OTT reference value for {k!r} (a lineax solve that failed to "
                f"converge also shows up as NaN: try larger lin_max_steps / looser "
                f"lin_rtol):\n{v}"
            )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python tests/ott_reference.py IN.npz OUT.npz", file=sys.stderr)
        sys.exit(2)
    os.environ["JAX_PLATFORMS"] = "cpu"
    _main(sys.argv[1], sys.argv[2])
