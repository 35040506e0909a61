"""KL-relaxed (unbalanced and semi-unbalanced) marginals: the rules, written once.

The problem. With rho_a, rho_b in (0, inf] (inf: that marginal is strict),

    min_P  <P, C> + eps KL(P | a b^T) + rho_a KL(P 1 | a) + rho_b KL(P^T 1 | b).

Two parametrizations of the same relaxation:

* OTT-JAX: ``tau_a``, ``tau_b`` in (0, 1], rho = eps tau / (1 - tau) (tau = 1: strict). The
  alternating updates are the balanced ones damped by tau (OTT's ``lse_step``),

      g <- tau_b (eps log b - eps LSE_i((f_i - C_ij)/eps)),
      f <- tau_a (eps log a - eps LSE_j((g_j - C_ij)/eps)),

  so that after the f-update P 1 = a exp(-f / rho_a) exactly. The marginal error (OTT's
  ``solution_error``, used for stopping when a tau < 1) is
  ||P 1 - a exp(-f/rho_a)||_1 + ||P^T 1 - b exp(-g/rho_b)||_1; in the alternating loop the
  first term is zero up to rounding, and the second rides on the next g-update
  (kernels/lse.py, RELAX_AT). ``reg_ot_cost`` is OTT's ``compute_kl_reg_cost`` at the returned
  potentials (:func:`ott_marginal_term`):

      div_a + div_b + eps (sum(a) sum(b) - sum(P)),
      div_a = sum_{a>0} a (f - eps log a)                     (tau_a = 1)
            = -sum_{a>0} a rho_a (exp(-(f - eps log a)/rho_a) - 1)   (tau_a < 1),

  and its derivatives in a, b, eps are those of this formula at fixed potentials (OTT's
  default implicit differentiation gives exactly these; in x and y the envelope gradient
  2 s (r_i x_i - sum_j P_ij y_j) is unchanged). The Sinkhorn divergence adds
  0.5 eps (sum(a) - sum(b))^2 to the three costs' combination (OTT's ``sinkhorn_divergence``).

* GeomLoss: ``reach`` (and flash-sinkhorn's ``reach_x`` / ``reach_y``: only the marginal of x,
  resp. y, relaxed), rho = reach^p. Each softmin is damped by 1 / (1 + eps / rho) = the tau of
  that rho at the current eps (:func:`damping`), and the loss (:func:`geomloss_weight`) is

      sum_i a_i (rho + eps/2) (1 - exp(-f_i / rho))             (debias=False)
      sum_i a_i (rho + eps/2) (exp(-f_aa,i / rho) - exp(-f_ba,i / rho))   (debias=True)

  (plus the same on the b side), with a strict side keeping GeomLoss's balanced term
  <a, f> (resp. <a, f_ba - f_aa>). GeomLoss 0.3.1 applies the factor rho + eps/2 as a plain
  multiplication, so its gradients carry rho + eps/2 as well; ours do the same.
  With rho_x != rho_y (``reach_x`` / ``reach_y``) the self problems and the translation of a
  problem with one relaxed marginal follow flash-sinkhorn (the block at the end of this file).

In the kernels a relaxed side reads (tau, 1/rho) from PARAMS at the index :data:`RELAX_AT`
gives it: PARAMS = [eps, s, tau_a, 1/rho_a, tau_b, 1/rho_b] (:func:`params_tail`).

Every function here takes the frontend's array module as ``xp`` (``torch`` or
``jax.numpy``) where it computes, and only uses operations both share.
"""

from __future__ import annotations

import math
from numbers import Real

RELAX_AT = {"a": 2, "b": 4}  # index of (tau, 1/rho) of each side in PARAMS


def check_tau(name: str, tau) -> float:
    """``tau`` as a float in (0, 1]; a ValueError naming the argument otherwise."""
    if isinstance(tau, bool) or not isinstance(tau, Real):
        raise TypeError(f"{name} must be a float in (0, 1] (1: that marginal is strict), got {tau!r}")
    t = float(tau)
    if not (0.0 < t <= 1.0):
        raise ValueError(f"{name} must lie in (0, 1] (1: that marginal is strict; rho = eps {name} / "
                         f"(1 - {name})), got {t}")
    return t


def check_reach(name: str, reach) -> float | None:
    """``reach`` as a positive finite float, or None (strict marginal)."""
    if reach is None:
        return None
    if isinstance(reach, bool) or not isinstance(reach, Real):
        raise TypeError(f"{name} must be None (balanced) or a positive float, got {reach!r}")
    r = float(reach)
    if not (r > 0.0 and math.isfinite(r)):
        raise ValueError(f"{name} must be a positive finite float (the scale of the KL relaxation of the "
                         f"marginal, rho = {name}**p), or None for a strict marginal; got {r}")
    return r


def rho(eps: float, tau: float) -> float:
    """OTT's rho = eps tau / (1 - tau) (inf for tau = 1)."""
    return math.inf if tau == 1.0 else eps * tau / (1.0 - tau)


def inv_rho(eps: float, tau: float) -> float:
    """1 / rho = (1 - tau) / (eps tau) (0 for tau = 1)."""
    return (1.0 - tau) / (eps * tau)


def is_balanced(tau_a, tau_b) -> bool:
    """Both marginals strict: tau_a = tau_b = 1 as numbers. An array tau (a traced or tensor
    GeomLoss damping rho / (rho + eps), always < 1) counts as relaxed."""
    return all(isinstance(t, Real) and t == 1.0 for t in (tau_a, tau_b))


def params_tail(eps: float, tau_a: float, tau_b: float) -> list[float]:
    """The PARAMS entries after [eps, s] of a problem with a relaxed side: [tau_a, 1/rho_a,
    tau_b, 1/rho_b] (none for a balanced problem)."""
    if is_balanced(tau_a, tau_b):
        return []
    return [tau_a, inv_rho(eps, tau_a), tau_b, inv_rho(eps, tau_b)]


def relax_at(side: str, tau: float) -> int:
    """The kernels' RELAX_AT of one side: 0 when strict, else its index in PARAMS."""
    return 0 if tau == 1.0 else RELAX_AT[side]


def damping(eps: float, rho_: float | None) -> float:
    """GeomLoss's damping of a softmin, 1 / (1 + eps / rho) (1 without a reach)."""
    return 1.0 if rho_ is None else 1.0 / (1.0 + eps / rho_)


def reach_to_rho(reach: float | None, p: int) -> float | None:
    """GeomLoss's rho = reach^p (None: strict)."""
    return None if reach is None else float(reach) ** p


def tau_from_rho(eps: float, rho_: float | None) -> float:
    """The tau of a rho at this eps: rho / (rho + eps) (1 for a strict marginal)."""
    return 1.0 if rho_ is None else rho_ / (rho_ + eps)


def _log_w(xp, w):
    return xp.log(xp.where(w > 0, w, 1.0))


def ott_marginal_entries(xp, pot, w, eps, tau: float):
    """The per-entry terms of :func:`ott_marginal_term` (0 on zero weights): their sum over one
    problem's entries is its div_a (or div_b); a packed batch sums them per problem."""
    pos = w > 0
    u = xp.where(pos, pot, 0.0) - eps * _log_w(xp, w)
    if tau == 1.0:
        return xp.where(pos, w * u, 0.0)
    r = eps * (tau / (1.0 - tau))
    return -xp.where(pos, w * r * (xp.exp(-u / r) - 1.0), 0.0)


def ott_marginal_term(xp, pot, w, eps, tau: float):
    """div_a (or div_b) of OTT's reg_ot_cost for potential ``pot`` and weights ``w`` (module
    docstring); zero-weight entries (pot = -inf there) drop out. ``eps`` may be an array."""
    return ott_marginal_entries(xp, pot, w, eps, tau).sum()


def ott_marginal_partials(xp, pot, w, eps, tau: float):
    """(d div / d w, d div / d eps) of :func:`ott_marginal_term` at fixed ``pot``: per-entry
    (0 where w = 0, as OTT's masked formula gives) and a scalar."""
    pos = w > 0
    lw = _log_w(xp, w)
    p0 = xp.where(pos, pot, 0.0)
    u = p0 - eps * lw
    if tau == 1.0:
        return xp.where(pos, u - eps, 0.0), -(xp.where(pos, w * lw, 0.0)).sum()
    k = tau / (1.0 - tau)
    r = eps * k
    e = xp.exp(-u / r)
    dw = xp.where(pos, -r * (e - 1.0) - eps * e, 0.0)
    deps = -(xp.where(pos, w * (k * (e - 1.0) + e * p0 / eps), 0.0)).sum()
    return dw, deps


def divergence_mass_term(mass_a, mass_b, eps):
    """OTT's correction of the unbalanced Sinkhorn divergence, 0.5 eps (sum(a) - sum(b))^2
    (eps held fixed in its derivatives, as OTT does)."""
    return 0.5 * eps * (mass_a - mass_b) ** 2


def geomloss_weight(xp, pot, rho_: float | None, eps: float):
    """GeomLoss's per-point dual term of one side: ``pot`` itself when strict, else
    (rho + eps/2) (1 - exp(-pot / rho)); the loss is the weights' dot product with it (with
    debiasing, the difference of the cross and self terms)."""
    if rho_ is None:
        return pot
    return (rho_ + 0.5 * eps) * (1.0 - xp.exp(-pot / rho_))


def geomloss_weight_slope(xp, pot, rho_: float | None, eps: float):
    """d :func:`geomloss_weight` / d pot: 1 when strict, else (1 + eps / (2 rho)) exp(-pot / rho)."""
    if rho_ is None:
        return xp.ones_like(pot)
    return (1.0 + 0.5 * eps / rho_) * xp.exp(-pot / rho_)


def geomloss_hessian_sides(rho_x: float | None, rho_y: float | None, eps, terms: bool):
    """((tau_x, tau_y), (c_x, c_y)) of GeomLoss's relaxed loss: its gradient field in (x, y) is

        G_x = c_x grad_x R(x, y) - 1/2 [c_x grad_1 R_a(x, x) + c_y grad_2 R_a(x, x)]   (debias),

    and G_y alike (core.implicit_derivatives.debiased_hessian_apply), R the relaxed reg_ot_cost of
    OTT (tau_x = rho_x / (rho_x + eps) on each problem's first marginal, tau_y on its second,
    C = |x - y|^2 / 2) at the final potentials, and per side

        c = damping(eps, rho) (1 + eps / (2 rho)) = (rho + eps/2) / (rho + eps)   (1 when strict),

    because the last extrapolation's row i of the x side is damping x weight slope x the
    row-normalised plan's mean, a_i exp(-f_i / rho) (x_i - (P y)_i / r_i) with r = P 1 =
    a exp(-f / rho) the exact envelope row of R. With one reach on both sides this is c times the
    gradient of OTT's relaxed Sinkhorn divergence (GeomLoss's loss equals it at the fixed point);
    with reach_x != reach_y the Jacobian of (G_x, G_y) is not symmetric (the second derivatives
    of a torch double backward are its transpose, those of a JAX jvp of grad the Jacobian itself).
    ``eps`` may be an array (the frontends' last eps). Second derivatives of the potentials
    (``terms`` False: their per-point factors exp(-f_i / rho) differ) raise NotImplementedError."""
    if not terms:
        raise NotImplementedError("second derivatives of the potentials of samples_loss with reach are not "
                                  "implemented; the loss value is twice differentiable in x and y")
    side = lambda r: (1.0, 1.0) if r is None else (r / (r + eps), (r + 0.5 * eps) / (r + eps))
    (tx, cx), (ty, cy) = side(rho_x), side(rho_y)
    return (tx, ty), (cx, cy)


# ----------------------------------------------------------------------------- one relaxed marginal
# flash-sinkhorn 0.4.1 (``reach_x`` / ``reach_y``): the self problems of the debiased loss and the
# translation of a problem with exactly one relaxed marginal.


def self_problems_split(rho_x: float | None, rho_y: float | None) -> bool:
    """Whether the debiasing problems OT(a, a), OT(b, b) (rho_x on their first marginal, rho_y on
    their second, as flash-sinkhorn solves them) have two different potentials: rho_x != rho_y.
    With rho_x == rho_y (strict or GeomLoss's ``reach``) each is GeomLoss's symmetric problem with
    one potential."""
    return rho_x != rho_y


def _lse(xp, t):
    """log sum exp(t) over a 1-D array with -inf entries (at least one finite)."""
    m = t.max()
    return m + xp.log(xp.exp(t - m).sum())


def semi_unbalanced_translate(xp, f, g, logw_f, logw_g, rho_f: float | None, rho_g: float | None):
    """flash-sinkhorn's ``_translate_semi_unbalanced`` in GeomLoss's convention: with exactly one
    marginal relaxed, the dual is maximised in closed form along (f + c, g - c) (the entropic term
    does not change along it). Relaxed g (strict f):

        c = rho_g (log sum(w_f) - log sum_j w_g,j exp(-g_j / rho_g)),   (f, g) <- (f + c, g - c);

    relaxed f (strict g): c = rho_f (log sum(w_g) - log sum_i w_f,i exp(-f_i / rho_f)),
    (f, g) <- (f - c, g + c). Afterwards the relaxed side's plan mass sum w exp(-pot / rho)
    equals the strict side's mass. (f, g) unchanged when both or neither side is relaxed.
    ``logw_*``: log weights, -inf on zero weights (those drop out)."""
    if (rho_f is None) == (rho_g is None):
        return f, g
    if rho_g is not None:
        t = xp.where(logw_g > -math.inf, logw_g - g / rho_g, -math.inf)
        c = rho_g * (_lse(xp, logw_f) - _lse(xp, t))
        return f + c, g - c
    t = xp.where(logw_f > -math.inf, logw_f - f / rho_f, -math.inf)
    c = rho_f * (_lse(xp, logw_g) - _lse(xp, t))
    return f - c, g + c


# ----------------------------------------------------------------------------- OTT reg_ot_cost (JAX frontend)


def ott_reg_cost_terms(xp, f, g, a, b, eps, tau_a: float, tau_b: float, total):
    """The three terms (div_a, div_b, eps (sum a sum b - total)) of OTT's reg_ot_cost at (f, g),
    ``total`` = sum P (module docstring); the caller adds them (with compensation if it likes)."""
    return (ott_marginal_term(xp, f, a, eps, tau_a), ott_marginal_term(xp, g, b, eps, tau_b),
            eps * (a.sum() * b.sum() - total))


def ott_cost_partials(xp, f, g, a, b, eps, tau_a: float, tau_b: float):
    """(dR/da, dR/db, dR/deps minus its plan part) of OTT's reg_ot_cost R at fixed (f, g):
    dR/da = d div_a/da + eps sum(b) (the mass term eps sum a sum b; likewise b), and the eps
    derivative of div_a + div_b + eps sum a sum b, to which the caller adds that of
    -eps sum P (which needs the plan: -sum P + <P, f + g - C> / eps)."""
    ga, ea = ott_marginal_partials(xp, f, a, eps, tau_a)
    gb, eb = ott_marginal_partials(xp, g, b, eps, tau_b)
    sa, sb = a.sum(), b.sum()
    return ga + eps * sb, gb + eps * sa, ea + eb


# ----------------------------------------------------------------------------- multiscale (OTT convention)


def ott_from_damped(xp, F, G, a, b, eps: float, tau_a: float, tau_b: float):
    """(f, g, sum P) of OTT's relaxed problem from the potentials (F, G) of its damped GeomLoss form
    on the weights a^tau_a, b^tau_b (multiscale_rules.ott_relaxed_weights): f = F + tau_a eps log a
    (-inf where a = 0), g likewise, and sum P = sum_{a > 0} a exp(-f / rho_a) (sum a when strict), the
    exact mass of the plan from (f, the g that produced it) (its rows sum to a exp(-f / rho_a))."""
    pos = a > 0
    f = xp.where(pos, F + tau_a * eps * _log_w(xp, a), -math.inf)
    g = xp.where(b > 0, G + tau_b * eps * _log_w(xp, b), -math.inf)
    if tau_a == 1.0:
        return f, g, a.sum()
    return f, g, xp.where(pos, a * xp.exp(-xp.where(pos, f, 0.0) * inv_rho(eps, tau_a)), 0.0).sum()


# ----------------------------------------------------------------------------- fixed-shift hints


def shift_hint(p, p_prev):
    """The potential the next fixed-shift prediction of a problem with a relaxed side is taken from
    (kernels/lse.py, FOLD: POLD, divided by tau on a relaxed side), in place of the previous
    potential p when no error is measured on it; both sides drift.

    A relaxed problem has no gauge: the constant mode (f + c, g - c) contracts by tau_a tau_b per
    iteration instead of being free, so early iterations move every potential by nearly the same
    amount (at n = m = 65536, d = 64, eps = 0.1, tau = 10/11: ~110 in the kernels' log2 units at
    the second iteration, decaying by ~0.85 per iteration), more than the fixed shift tolerates
    (kernels/lse.py: rejected blocks are recomputed with the online max). The linear extrapolation
    2 p - p_prev is off by the change of that step, (1 - rate) times it. Non-finite entries (zero
    weights) give a non-finite hint, which the kernel replaces by 0 (its rows are not checked)."""
    return 2.0 * p - p_prev


def folds(it: int, cold: bool, relaxed: bool) -> tuple[bool, bool]:
    """Whether iteration ``it`` of the alternating loop (g then f) predicts its (g, f) updates'
    shifts (kernels/lse.py, FOLD) or runs them with the online max. A prediction that misses is
    recomputed, so a half-step whose prediction cannot hold costs two passes; these run online:

    * the g-update of iteration 0 (no previous g of the loop);
    * the f-update of iteration 0 from the zero start (``cold``): f itself is ~min_j C_ij, e.g.
      ~600 log2 units off at n = m = 2048, d = 64, eps = 0.1 (balanced: 40% of the rows, so
      nearly every row block, rejected);
    * with a relaxed side and the zero start, both updates of iteration 1: the extrapolation
      (:func:`shift_hint`) has only the zero start behind it, and the plain previous potential is
      50-120 units off (the constant mode's first drift; 95% of the f rows rejected there).
    From there every prediction holds (float64 simulation of the loop; one H200 at 65536, d = 64:
    the relaxed call's 10 iterations cost 1.11x the balanced ones with these three half-steps
    folded)."""
    early = relaxed and cold and it == 1
    return it > 0 and not early, not (it == 0 and cold) and not early
