"""The JAX derivative rules: OTT's reg_ot_cost (envelope theorem) and GeomLoss's potentials.

Both are ``jax.custom_vjp`` whose backward passes are plain functions of arrays
(:func:`envelope_grads`, :func:`side_direction`), so a later ``custom_jvp`` can
wrap them for forward-over-reverse (HVPs) without touching the rules here.
Static arguments are frozen dataclasses (hashable).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import kernel_ops
from . import geomloss_schedule as schedule
from .envelope_grads import CostGrads, cost_grads
from .kernel_ops import Cloud, clouds, make_params, masked_log
from .label_inputs import check_unlabelled, pair_clouds
from .summation import accurate_sum
from .geomloss_packed import vmappable_geomloss
from ..core import unbalanced
from ..core.implicit_derivatives import debiased_hessian_apply
from .implicit import ImplicitConfig, Passes, eps_scale_gradients, gradients, warn_unconverged
from .loops import GEOMLOSS_SCALE


KernelConfig = ImplicitConfig  # precision, launcher and the CG options of second order


@dataclass(frozen=True)
class GeomLossConfig:
    debias: bool = True
    precision: str = "float32"
    backend: str | None = None


# ============================================================================= OTT's reg_ot_cost


def cost_value(a, b, eps, f, g, total, taus=(1.0, 1.0)):
    """sum_{a>0} a (f - eps log a) + sum_{b>0} b (g - eps log b) + eps (sum a sum b - total), summed
    with compensation (:func:`.summation.accurate_sum`: its terms can be far larger than it).
    With a relaxed marginal (``taus`` = OTT's (tau_a, tau_b) not (1, 1)) OTT's unbalanced cost
    div_a + div_b + eps (sum a sum b - total) (core.unbalanced.ott_reg_cost_terms)."""
    if not unbalanced.is_balanced(*taus):
        terms = unbalanced.ott_reg_cost_terms(jnp, f, g, a, b, eps, *taus, total)
        return accurate_sum(jnp.stack([jnp.asarray(t, a.dtype) for t in terms]))
    fa = jnp.where(a > 0, a * (f - eps * masked_log(a)), 0.0)
    gb = jnp.where(b > 0, b * (g - eps * masked_log(b)), 0.0)
    mass = eps * (accurate_sum(a) * accurate_sum(b) - total)
    return accurate_sum(jnp.concatenate([fa, gb, mass.reshape(1)]))


def plan_mass(X: Cloud, Y: Cloud, f, g, prm, cfg: KernelConfig, tf32_total) -> jax.Array:
    """sum P for the mass term of reg_ot_cost (stop-gradient): with "float32" one row-sum
    pass with the unbiased "fixed4" cross term (the dual objective is stationary in (f, g),
    so the unbiased cost removes the tensor cores' truncation bias to first order); with
    "tf32" ``tf32_total()``."""
    if cfg.precision == "float32":
        total = accurate_sum(kernel_ops.exact_row_mass(X, Y, f, g, prm, backend=cfg.backend))
    else:
        total = tf32_total()
    return jax.lax.stop_gradient(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def reg_ot_cost(cfg: KernelConfig, x, y, a, b, eps, s, f, g, total, labels=None):
    """OTT's reg_ot_cost at potentials (f, g) that solve the problem; envelope derivative.

    R = :func:`cost_value` with ``total`` = sum P (OTT's unbalanced cost when ``cfg.taus`` relaxes a
    marginal: then only first derivatives exist, see :mod:`.implicit`). Differentiable in x, y, a, b, eps,
    s by the envelope theorem: f, g (and total) are held fixed, their cotangents are
    zero. The backward is :func:`.implicit.gradients` (x, y, a, b), a ``custom_jvp``
    whose JVP is the Hessian (HVPs, ``jax.hessian``), and, only when epsilon or
    scale_cost is differentiated, :func:`.implicit.eps_scale_gradients` (whose own
    derivatives raise). ``labels``: (label_x, label_y, label_cost) of a labelled cost
    (:mod:`.label_inputs`), None without; no cotangent flows to them.
    """
    return cost_value(a, b, eps, f, g, total, cfg.taus)


def _reg_ot_cost_fwd(cfg, x, y, a, b, eps, s, f, g, total, labels=None):
    vals = tuple(v.value for v in (x, y, a, b, eps, s, f, g, total))
    eps_flag = None if not (eps.perturbed or s.perturbed) else jnp.zeros(())
    labels = jax.tree.map(lambda p: p.value, labels)
    return cost_value(*vals[2:5], *vals[6:], cfg.taus), vals[:8] + (eps_flag, labels)


def envelope_grads(x, y, a, b, eps, s, f, g, cfg: KernelConfig) -> CostGrads:
    """Gradient of reg_ot_cost in (x, y, a, b, eps, s) at fixed potentials (f, g): a plain
    function of arrays (cloud preparation included, no custom rule)."""
    X, Y = clouds(x, y, backend=cfg.backend)
    return cost_grads(X, Y, a, b, eps, s, f, g, precision=cfg.precision, backend=cfg.backend)


def _reg_ot_cost_bwd(cfg, res, ct):
    x, y, a, b, eps, s, f, g, eps_flag, labels = res
    if isinstance(ct, SymbolicZero):
        return (None,) * 10
    gx, gy, ga, gb = gradients(cfg, x, y, a, b, eps, s, f, g, labels)
    geps = gs = None
    if eps_flag is not None:
        geps, gs = eps_scale_gradients(cfg, x, y, a, b, eps, s, f, g, labels)
        geps, gs = ct * geps, ct * gs
    return (ct * gx, ct * gy, ct * ga, ct * gb, geps, gs, None, None, None, None)


reg_ot_cost.defvjp(_reg_ot_cost_fwd, _reg_ot_cost_bwd, symbolic_zeros=True)


# ============================================================================= GeomLoss's potentials


def _forward(cfg: GeomLossConfig, x, y, a, b, sched, labels=None):
    sg = jax.lax.stop_gradient
    X, Y = pair_clouds(sg(x), sg(y), labels, cfg.backend)
    a, b, sched = sg(a), sg(b), sg(sched)
    la, lb = masked_log(a), masked_log(b)
    # under vmap: one packed loop for the batch (geomloss_packed), or one loop per problem
    old, new = vmappable_geomloss(cfg.debias, cfg.precision, cfg.backend)(X, Y, la, lb, sched)
    F, G = (new[0] - new[2], new[1] - new[3]) if cfg.debias else (new[0], new[1])
    return (F, G), (X, Y, la, lb, old, new, schedule.last_eps(sched))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def geomloss_potentials(cfg: GeomLossConfig, x, y, a, b, sched, labels=None):
    """(F, G) of one problem; derivative in x, y by GeomLoss's rule, none in a, b, sched
    (GeomLoss detaches them inside its last extrapolation) nor in ``labels`` ((label_x, label_y, W)
    of a labelled cost, :mod:`.label_inputs`: the clouds carry them; second derivatives raise)."""
    return _forward(cfg, x, y, a, b, sched, labels)[0]


def side_direction(S: Cloud, T: Cloud, f, g_w, h, h_w, prm, cfg: GeomLossConfig, own: Cloud | None = None):
    """dF_i/dx_i (rows of S): (Q s)_i - (P t)_i with the row-normalised plans of the last
    extrapolation (s_i - (P t)_i without debias). ``g_w``, ``h_w``: the old potentials
    with eps log w folded in, so P and Q are GeomLoss's softmax weights. ``own``: the whole
    cloud Q's columns run over when S is only some of its rows (default S)."""
    pt, r = kernel_ops.apply_plan(S, T, f, g_w, prm, precision=cfg.precision, backend=cfg.backend, v=T.x)
    mean_t = pt / r[:, None]
    if not cfg.debias:
        return S.x - mean_t
    own = S if own is None else own
    qs, q = kernel_ops.apply_plan(S, own, h, h_w, prm, precision=cfg.precision, backend=cfg.backend, v=own.x)
    return qs / q[:, None] - mean_t


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def geomloss_grads(cfg: GeomLossConfig, x, y, uF, uG, saved):
    """(uF dF/dx, uG dG/dy) by GeomLoss's rule at the saved solve (``x``, ``y`` only carry
    tangents: the kernels read the centred clouds of ``saved``). Its JVP makes the loss twice
    differentiable: dF_i/dx_i = (1/a_i) dS/dx_i (p = 2), so d(uF dF/dx) = duF dF/dx
    + uF / a * (Hessian of S applied to the tangent), S the converged loss at eps = blur^2
    (core.implicit_derivatives.debiased_hessian_apply at the final potentials)."""
    dx, dy = _directions(cfg, saved)
    return uF[:, None] * dx, uG[:, None] * dy


def _directions(cfg: GeomLossConfig, saved):
    """(dF/dx, dG/dy) row by row, GeomLoss's rule at the saved solve."""
    X, Y, la, lb, old, new, eps = saved
    f_ba, g_ab, f_aa, g_bb = new
    of_ba, og_ab, of_aa, og_bb = old
    prm = make_params(eps, GEOMLOSS_SCALE)
    debias = cfg.debias
    dx = side_direction(X, Y, f_ba, og_ab + eps * lb, f_aa, of_aa + eps * la if debias else None, prm, cfg)
    dy = side_direction(Y, X, g_ab, of_ba + eps * la, g_bb, og_bb + eps * lb if debias else None, prm, cfg)
    return dx, dy


def _geomloss_grads_jvp(cfg: GeomLossConfig, primals, tangents):
    x, y, uF, uG, saved = primals
    tx, ty, tuF, tuG, _ = tangents
    out = geomloss_grads(cfg, x, y, uF, uG, saved)
    saved = jax.tree.map(jax.lax.stop_gradient, saved)
    zero = lambda t: t is None or isinstance(t, SymbolicZero)
    res_x, res_y = jnp.zeros_like(out[0]), jnp.zeros_like(out[1])
    if not (zero(tuF) and zero(tuG)):
        dx, dy = _directions(cfg, saved)
        res_x = res_x if zero(tuF) else tuF[:, None] * dx
        res_y = res_y if zero(tuG) else tuG[:, None] * dy
    if not (zero(tx) and zero(ty)):
        hx, hy = loss_hessian_rows(saved, None if zero(tx) else tx, None if zero(ty) else ty, uF, uG,
                                   ImplicitConfig(cfg.precision, cfg.backend), cfg.debias)
        res_x, res_y = res_x + hx, res_y + hy
    return out, (res_x, res_y)


def loss_hessian_rows(saved, tx, ty, uF, uG, icfg: ImplicitConfig, debias: bool, rhos=(None, None)):
    """(uF / a) (J t)_x and (uG / b) (J t)_y: the tangent of (uF dF/dx, uG dG/dy) along t = (tx, ty)
    (None: zero) when dF_i/dx_i = (1 / a_i) G_x,i, J the Jacobian of the gradient field G at the saved
    final potentials (core.implicit_derivatives.debiased_hessian_apply): the Hessian of the converged
    loss S with strict marginals; with ``rhos`` = (rho_x, rho_y) (GeomLoss's reach^2 per marginal,
    None: strict) OTT's relaxed costs with the per-side factors of ``unbalanced.geomloss_hessian_sides``
    (split self potentials [p, q] when rho_x != rho_y)."""
    X, Y, la, lb, old, new, eps = saved
    check_unlabelled(None if X.labels is None else True, "A second derivative (HVP) of samples_loss")
    f_ba, g_ab, f_aa, g_bb = new
    a, b = jnp.exp(la), jnp.exp(lb)
    taus, scales = (1.0, 1.0), (1.0, 1.0)
    if rhos != (None, None):
        taus, scales = unbalanced.geomloss_hessian_sides(*rhos, eps, True)
    split = unbalanced.self_problems_split(*rhos)

    def own(h, lw):
        if not debias:
            return None
        n = lw.shape[0]
        return (h[:n] + eps * lw, h[n:] + eps * lw) if split else h + eps * lw

    pot = (f_ba + eps * la, g_ab + eps * lb, own(f_aa, la), own(g_bb, lb))
    pair = lambda h: h if isinstance(h, tuple) else (h, h)
    ops_xy = Passes(X, Y, pot[0], pot[1], eps, GEOMLOSS_SCALE, icfg)
    ops_xx = Passes(X, X, *pair(pot[2]), eps, GEOMLOSS_SCALE, icfg) if debias else None
    ops_yy = Passes(Y, Y, *pair(pot[3]), eps, GEOMLOSS_SCALE, icfg) if debias else None
    (hx, hy), infos = debiased_hessian_apply(ops_xy, ops_xx, ops_yy, pot, a, b, tx, ty, icfg.options, taus, scales)
    for info in infos:
        warn_unconverged(info, icfg, "HVP of samples_loss")
    rows_x = jnp.where(a > 0, uF / jnp.where(a > 0, a, 1.0), 0.0)
    rows_y = jnp.where(b > 0, uG / jnp.where(b > 0, b, 1.0), 0.0)
    return rows_x[:, None] * hx, rows_y[:, None] * hy


geomloss_grads.defjvp(_geomloss_grads_jvp, symbolic_zeros=True)


def _potentials_fwd(cfg: GeomLossConfig, x, y, a, b, sched, labels=None):
    out, saved = _forward(cfg, x, y, a, b, sched, labels)
    return out, (x, y, saved)


def _potentials_bwd(cfg: GeomLossConfig, res, cts):
    x, y, saved = res
    uF, uG = cts
    gx, gy = geomloss_grads(cfg, x, y, uF, uG, saved)
    # GeomLoss detaches the weights and the schedule: no cotangent for them
    return (gx, gy, None, None, None, None)


geomloss_potentials.defvjp(_potentials_fwd, _potentials_bwd)
