"""The linear system of implicit differentiation, solved by streaming conjugate gradient.

Written once for both frontends: the functions here only use array operators and
methods that torch tensors and JAX arrays share, plus the frontend's module as
``ops.xp`` (``torch`` or ``jax.numpy``: ``where``, ``zeros_like``, ``sqrt``, ``maximum``,
``concatenate``) and its loop as ``ops.while_loop(cond, body, state)``. The plan is
never formed: every product with it is a streaming pass of ``ops`` (:class:`PlanPasses`).

The system. At a solution of the balanced problem (OTT conventions,
P_ij = exp((f_i + g_j - C_ij)/eps), r = P 1, c = P^T 1), a perturbation of the inputs
moves the potentials by (df, dg) solving

    H [df; dg] = [rhs_f; rhs_g],      H = [[diag(r), P], [P^T, diag(c)]]

(the first-order conditions r = a, c = b, linearized and multiplied by eps). H is
symmetric positive semi-definite; its null space is the gauge direction (1, -1)
(f + t, g - t leave P unchanged), plus the coordinates of points with zero weight
(their rows of P vanish). The system is solved on the Schur complement of the larger
side, e.g. for n >= m

    S dg = rhs_g - P^T diag(1/r) rhs_f,   S = diag(c) - P^T diag(1/r) P,
    df = diag(1/r) (rhs_f - P dg),

whose null vector is 1 (S 1 = c - P^T 1 = 0). The singular direction is handled by
projection: the right-hand side, every residual and every preconditioned residual
are projected onto the zero-sum vectors of the active (positive-weight) entries, so CG
runs in the space where S is positive definite and returns the solution with
sum(dg) = 0 (the gauge of the result; :mod:`.implicit_derivatives` says which outputs
depend on it). The right-hand sides built there are consistent (orthogonal to the
null space) by construction.

KL-relaxed marginals (OTT's tau_a, tau_b < 1, rho = eps tau / (1 - tau);
:mod:`.unbalanced`). The fixed point of the damped updates is r = a exp(-f/rho_a),
c = b exp(-g/rho_b); linearized and multiplied by eps these read

    H [df; dg] = [rhs_f; rhs_g],      H = [[diag(r/tau_a), P], [P^T, diag(c/tau_b)]]

(eps d log r_i = df_i + (P dg)_i / r_i - e_i / r_i, and eps (1/rho + 1/eps) = 1/tau).
With a tau < 1 the gauge direction is gone (H (1, -1) = ((1/tau_a - 1) r, (1 - 1/tau_b) c)
is not 0): H is positive definite on the active entries, S = diag(c/tau_b) -
P^T diag(tau_a/r) P has S 1 = (1/tau_b - tau_a) c > 0, and CG runs on the masked (not
centred) vectors. ``taus`` = (1, 1) is the balanced solve above, operation for operation.

Each CG iteration costs two streaming passes (P z, then P^T of the result).
Preconditioners (:class:`ImplicitOptions`):

* ``"none"``;
* ``"jacobi"``: diag(S)_j = c_j - sum_i P_ij^2 / r_i, from one extra pass at the
  start (P_ij^2 is the plan at eps/2), floored at 1e-4 c_j (c_j where not finite);
* ``"neumann"``: S = diag(c)(I - M), M = diag(1/c) P^T diag(1/r) P, and
  S^-1 ~ (I + M + ... + M^k) diag(1/c) with k = ``neumann_terms`` (2k extra passes
  per iteration; M's eigenvalues lie in [0, 1], so the truncated series is a
  symmetric positive preconditioner).

Stopping: on the error that the derivatives see, not on the residual. Both sides' outputs
are linear in dP_ij / P_ij = (df_i + dg_j - dC_ij)/eps, so the error that matters is
sum_ij P_ij (e_f,i + e_g,j)^2 for the error (e_f, e_g) of the potentials' update, which
(e_f eliminated exactly) is e_g^T S e_g: the energy norm of the Schur system. CG estimates it
from its own coefficients (:func:`cg`) and stops when the estimated energy error is at most
rtol times the energy norm of the update (or at most atol), at most ``max_iter`` iterations.
A Euclidean residual test ||S e_g|| <= rtol ||rhs|| (the rule before) does not bound that
error: the residual is smallest on S's small eigenvalues and on small weights c_j (where
e_g,j ~ residual_j / c_j), exactly the components CG resolves last, and the CG side's own
marginal equation keeps the residual (sum_i dP_ij is off by residual_j), which enters that
side's output as residual_j times its transport displacement / eps. At rtol 1e-4 it gave
HVPs up to ~3e-4 (relative) from exact on the CG side (y when n >= m) with non-uniform
weights; the energy rule at the same rtol gives <= ~6e-5 on both sides for 3 to 5 more
iterations. The frontends warn when CG stops
unconverged and return (iterations, relative residual, converged) beside results
that ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from . import checks
from .unbalanced import is_balanced

PRECONDITIONERS = ("none", "jacobi", "neumann")
ERROR_DELAY = 3  # CG steps between the iterate whose error is estimated and the one returned


@dataclass(frozen=True)
class ImplicitOptions:
    """Options of the conjugate-gradient solve of implicit differentiation.

    Attributes:
        rtol, atol: stop when the estimated energy-norm error of the potentials' update (module
            docstring: sum_ij P_ij (error of df_i + dg_j)^2, the error both sides' derivatives are
            linear in) is <= rtol times the update's energy norm, or <= atol. The default 1e-4 keeps
            HVPs and implicit VJPs within 1e-4 (relative) of the exact solve at the same potentials
            on both sides, with non-uniform weights and n != m (tests/test_hvp_default_accuracy.py).
            A Euclidean residual test at the same rtol is cheaper by 3 to 5 iterations but lets the
            side solved by CG (y when n >= m) reach 2e-4 to 4e-3. At the default forward threshold
            (1e-3) the forward solve's accuracy dominates the HVP's error on hard problems (small
            eps): converge the forward (threshold 1e-6) for derivatives at the 1e-4 level.
        max_iter: iteration cap (each iteration = two streaming passes).
        preconditioner: "none" (default), "jacobi" or "neumann" (module docstring). Jacobi costs one
            extra pass and cuts CG from 380 to 42 iterations at n = m = 8192, d = 64, eps = 0.1 (H100),
            but in float32 it breaks down (p^T S p <= 0) at rtol 1e-5 there, and restarting after
            such breakdowns lets the iterate drift (docs/performance.md): not the default.
        neumann_terms: k of the Neumann series (>= 1).
        warn: warn when CG stops before reaching the tolerance.
    """

    rtol: float = 1e-4
    atol: float = 0.0
    max_iter: int = 1000
    preconditioner: str = "none"
    neumann_terms: int = 3
    warn: bool = True

    def __post_init__(self):
        if not (isinstance(self.rtol, (int, float)) and 0.0 <= self.rtol < 1.0):
            raise ValueError(f"ImplicitOptions.rtol must be a number in [0, 1), got {self.rtol!r}")
        if not (isinstance(self.atol, (int, float)) and self.atol >= 0.0):
            raise ValueError(f"ImplicitOptions.atol must be a number >= 0, got {self.atol!r}")
        if self.rtol == 0.0 and self.atol == 0.0:
            raise ValueError("ImplicitOptions: rtol and atol are both 0; CG could never stop on its own. "
                             "Set rtol (e.g. 1e-5) or atol > 0.")
        if not (isinstance(self.max_iter, int) and self.max_iter >= 1):
            raise ValueError(f"ImplicitOptions.max_iter must be an int >= 1, got {self.max_iter!r}")
        if self.preconditioner not in PRECONDITIONERS:
            raise ValueError(f"ImplicitOptions.preconditioner must be one of {PRECONDITIONERS}, "
                             f"got {self.preconditioner!r}")
        if not (isinstance(self.neumann_terms, int) and self.neumann_terms >= 1):
            raise ValueError(f"ImplicitOptions.neumann_terms must be an int >= 1, got {self.neumann_terms!r}")


def options_key(opts: ImplicitOptions) -> str:
    """The options as one string (an attribute of torch custom ops: constant under torch.compile)."""
    return (f"{opts.rtol!r};{opts.atol!r};{opts.max_iter};{opts.preconditioner};{opts.neumann_terms};"
            f"{int(opts.warn)}")


def options_from_key(key: str) -> ImplicitOptions:
    rtol, atol, it, prec, k, warn = key.split(";")
    return ImplicitOptions(float(rtol), float(atol), int(it), prec, int(k), bool(int(warn)))


def unconverged_message(what: str, iterations: int, residual: float) -> str:
    return (f"{what}: conjugate gradient stopped unconverged after {iterations} iterations (relative residual "
            f"{residual:.2e}); the derivative is inaccurate. Raise ImplicitOptions.max_iter, loosen rtol, or try "
            "preconditioner='jacobi'.")


def implicit_options(value) -> ImplicitOptions:
    """``None`` -> the defaults; an :class:`ImplicitOptions` as is; anything else raises."""
    if value is None:
        return ImplicitOptions()
    if not isinstance(value, ImplicitOptions):
        raise TypeError(f"implicit must be an ImplicitOptions (or None for the defaults), got {type(value).__name__}")
    return value


class PlanPasses(Protocol):
    """What a frontend supplies: the streaming passes of one plan P (n x m) and its array module.

    x (n, d), y (m, d): the clouds (float32); eps, s: 0-d arrays; n, m: sizes.
    Batches: x (B, n, d), y (B, m, d) and every vector with the same leading dims, (B, n) /
    (B, m) (B problems sharing eps and s; a pass serves all of them): the math reduces over the
    last axis only, so each problem has its own projections, inner products and CG stop.
    apply(v) -> (P v or None, P 1) for v (m, k) or None; apply_t(u) -> (P^T u or None, P^T 1).
    apply_t_sq(u) -> sum_i P_ij^2 u_i (m,) for u (n,) (the plan at eps/2).
    weighted(w, A, B) -> sum_j P_ij <w_i, A_j> B_j (n, p); weighted_t the same with P^T.
    transposed() -> the passes of P^T (roles of the two sides swapped).
    xp: torch or jax.numpy; while_loop(cond, body, state) -> state.
    """

    x: Any
    y: Any
    eps: Any
    s: Any
    n: int
    m: int
    xp: Any
    while_loop: Callable

    def apply(self, v): ...
    def apply_t(self, u): ...
    def apply_t_sq(self, u): ...
    def weighted(self, w, A, B): ...
    def weighted_t(self, w, A, B): ...
    def transposed(self) -> "PlanPasses": ...


def col(v):
    """(..., k) -> (..., k, 1): a vector as one column, or per-problem scalars (..., ) as (..., 1)."""
    return v[..., None]


def project(xp, z, mask, centre: bool = True):
    """Zero-sum over the active entries, zero elsewhere (the null space of S removed); with
    ``centre`` False (a relaxed marginal: no null space) only the zeroing."""
    if not centre:
        return xp.where(mask, z, 0.0)
    k = col(mask.sum(-1))
    mean = col(xp.where(mask, z, 0.0).sum(-1)) / (k + (k == 0))
    return xp.where(mask, z - mean, 0.0)


def safe_inv(xp, v):
    return xp.where(v > 0, 1.0 / xp.where(v > 0, v, 1.0), 0.0)


def cg(ops: PlanPasses, matvec, rhs, prec, mask, opts: ImplicitOptions, centre: bool = True):
    """Preconditioned CG on the projected system matvec(z) = rhs (rhs already projected;
    ``centre``: :func:`project`'s).

    Stopping (module docstring): the error of the iterate in the energy norm of the system,
    estimated from CG's own coefficients (Hestenes-Stiefel): after step j the squared energy
    norm of the iterate grows by t_j = alpha_j (r_j^T M^-1 r_j), and the squared error of the
    iterate ``ERROR_DELAY`` steps back is at least the sum of the last ``ERROR_DELAY`` terms
    (exact in exact arithmetic up to the terms still to come). CG stops when that window is
    <= rtol^2 times the sum of all terms (the squared energy norm of the solution so far), or
    its square root is <= atol; the returned iterate is ``ERROR_DELAY`` steps past the
    estimated one, so its error is smaller still.

    Breakdown: S is positive definite on the projected space, so p^T S p <= 0 (or not finite)
    means the float32 products have reached the attainable accuracy (or overflowed); CG stops
    there without stepping. A step whose new residual is not finite is not taken either, and
    CG stops. The result is the last finite iterate, reported converged only if the last step
    taken changed the energy by at most the tolerance (a window of one term) or the residual is
    exactly zero (then p = 0 and p^T S p = 0: the iterate solves the system). (CG does not restart
    after a breakdown: with the Jacobi preconditioner at rtol 1e-6 on the H100 a restart lets the
    iterate drift to 1e19 while the recursive residual keeps shrinking; docs/performance.md.)

    Vectors may carry leading batch dims (:class:`PlanPasses`): every inner product, stop test
    and coefficient is then per problem (kept as (..., 1)), and the loop runs until the last
    problem stops. Returns (z, iterations, relative residual ||r|| / ||rhs||, converged), the last
    three 0-d (one problem) or (B,), as arrays of the frontend. Converged problems keep their state
    (the body is masked), so batched loops (a batch, vmap) stay exact: each problem's iterate is
    that of its own solve."""
    xp = ops.xp
    dot = lambda u, v: col((u * v).sum(-1))  # per problem, kept as (..., 1)
    norm = lambda v: xp.sqrt(dot(v, v))
    rhs_norm = norm(rhs)
    rtol2 = float(opts.rtol) ** 2
    z0 = xp.zeros_like(rhs)
    pr = project(xp, prec(rhs), mask, centre)
    rz = dot(rhs, pr)
    zero = rz * 0.0
    trivial = rhs_norm <= 0.0  # also covers a problem with no active entry
    # window: the last ERROR_DELAY energy terms (oldest first); energy: the sum of all terms
    window = tuple(zero for _ in range(ERROR_DELAY))
    state = (zero, z0, rhs, pr, rz, trivial, zero, window, trivial)

    def met_by(part, energy):
        return (part <= rtol2 * energy) | (xp.sqrt(part) <= opts.atol)

    def cond(st):
        k, done = st[0], st[5]
        return ((~done) & (k < opts.max_iter)).any()  # until the last problem of a batch stops

    def body(st):
        k, z, res, p, rz, done, energy, window, met = st
        q = matvec(p)
        pq = dot(p, q)
        ok = (pq > 0) & (pq < float("inf"))  # False for NaN
        alpha = xp.where(ok, rz / xp.where(ok, pq, 1.0), 0.0)
        res_try = project(xp, res - alpha * q, mask, centre)
        step = ok & (norm(res_try) < float("inf"))
        z_new = xp.where(step, z + alpha * p, z)
        res_new = xp.where(step, res_try, res)
        pz = project(xp, prec(res_new), mask, centre)
        rz_new = dot(res_new, pz)
        beta = xp.where(rz > 0, rz_new / xp.where(rz > 0, rz, 1.0), 0.0)
        p_new = pz + beta * p
        term = xp.where(step, alpha * rz, 0.0)
        energy_new = energy + term
        window_new = window[1:] + (term,)
        part = window_new[0]
        for t in window_new[1:]:
            part = part + t
        full = k + 1.0 >= ERROR_DELAY
        # no step: met if the last step taken was within the tolerance, or the residual is exactly
        # zero (a solve finished in fewer steps than the window, e.g. a one-point side)
        met_new = xp.where(step, full & met_by(part, energy_new),
                           ((k > 0) & met_by(window[-1], energy)) | (rz <= 0.0))
        done_new = met_new | ~step
        keep = done | (k >= opts.max_iter)  # a frontend may run the body past the cap between its tests
        w = lambda old, new: xp.where(keep, old, new)
        return (w(k, k + 1.0), w(z, z_new), w(res, res_new), w(p, p_new), w(rz, rz_new), done | done_new,
                w(energy, energy_new), tuple(w(a, b) for a, b in zip(window, window_new)), w(met, met_new))

    k, z, res, _, _, _, _, _, met = ops.while_loop(cond, body, state)
    rel = norm(res) / xp.where(rhs_norm > 0, rhs_norm, 1.0)
    return z, k[..., 0], rel[..., 0], met[..., 0]


def schur_solve(ops: PlanPasses, rhs_f, rhs_g, r, c, mask_f, mask_g, opts: ImplicitOptions,
                taus: tuple[float, float] = (1.0, 1.0)):
    """(df, dg, (iterations, relative residual, converged)) solving H [df; dg] = [rhs_f; rhs_g]
    (module docstring) on the Schur complement of the larger side; balanced (``taus`` = (1, 1)):
    sum(dg) = 0 (n >= m) or sum(df) = 0 (n < m) over the active entries. With a tau < 1 the
    diagonal blocks are diag(r/tau_f), diag(c/tau_g) and the solution is unique."""
    if ops.n < ops.m:
        dg, df, info = schur_solve(ops.transposed(), rhs_g, rhs_f, c, r, mask_g, mask_f, opts, taus[::-1])
        return df, dg, info
    xp = ops.xp
    centre = is_balanced(*taus)
    if not centre:  # the relaxed diagonal blocks r/tau_f, c/tau_g
        r, c = r / taus[0], c / taus[1]
    inv_r, inv_c = safe_inv(xp, r), safe_inv(xp, c)

    def apply_m(z):  # P^T diag(1/r) P z
        pz, _ = ops.apply(col(z))
        ptz, _ = ops.apply_t(col(inv_r * pz[..., 0]))
        return ptz[..., 0]

    def matvec(z):
        return c * z - apply_m(z)

    if opts.preconditioner == "jacobi":
        diag = c - ops.apply_t_sq(inv_r)
        # an entry lost to overflow (P^2 at eps/2: inf or NaN) falls back to c_j
        diag = xp.where(abs(diag) < float("inf"), diag, c)
        inv_diag = safe_inv(xp, xp.maximum(diag, 1e-4 * c))
        prec = lambda v: inv_diag * v
    elif opts.preconditioner == "neumann":
        def prec(v):
            term = inv_c * v
            acc = term
            for _ in range(opts.neumann_terms):
                term = inv_c * apply_m(term)
                acc = acc + term
            return acc
    else:
        prec = lambda v: v

    ptf, _ = ops.apply_t(col(inv_r * rhs_f))
    rhs = project(xp, rhs_g - ptf[..., 0], mask_g, centre)
    dg, k, rel, ok = cg(ops, matvec, rhs, prec, mask_g, opts, centre)
    pdg, _ = ops.apply(col(dg))
    df = inv_r * (rhs_f - pdg[..., 0])
    return df, dg, (k, rel, ok)


def symmetric_solve(ops: PlanPasses, rhs, r, mask, opts: ImplicitOptions, tau: float = 1.0):
    """(u, (iterations, relative residual, converged)) for a self problem (x against itself, a
    = b, f = g, so P is symmetric and r = c) and a symmetric right-hand side rhs_f = rhs_g =
    rhs: then df = dg = u with

        (diag(r / tau) + P) u = rhs,

    the system's restriction to the symmetric vectors. It is positive definite on the active
    entries (u^T (diag(r / tau) + P) u = 1/2 sum_ij P_ij (u_i + u_j)^2 + (1/tau - 1) u^T diag(r) u,
    and P_ii > 0) and well conditioned: P = diag(e^{f/eps}) K diag(e^{f/eps}) with the Gaussian
    kernel K positive semi-definite, so diag(r)^{-1/2} P diag(r)^{-1/2} has its spectrum in
    [0, 1] and, preconditioned by diag(tau / r) (free), the system's in [1, 1 + tau]. The Schur
    system of :func:`schur_solve` holds the antisymmetric part too, diag(r) - P, whose small
    eigenvalues (a near-diagonal P at small eps) make its CG crawl. One pass per iteration; CG
    minimizes that quadratic form of the error e (1/2 sum_ij P_ij (e_i + e_j)^2, plus
    (1/tau - 1) e^T diag(r) e when relaxed), the error the derivatives see.
    ``opts.preconditioner`` is not used here."""
    xp = ops.xp
    d = r / tau
    inv_d = safe_inv(xp, d)

    def matvec(z):
        pz, _ = ops.apply(col(z))
        return d * z + pz[..., 0]

    u, k, rel, ok = cg(ops, matvec, project(xp, rhs, mask, False), lambda v: inv_d * v, mask, opts, False)
    return u, (k, rel, ok)


def check_no_eps_tangent(name: str, perturbed: bool) -> None:
    """Second derivatives involving epsilon or scale_cost are not implemented: raise."""
    if perturbed:
        raise NotImplementedError(checks.second_order_message(name))
