"""GeomLoss's annealed Sinkhorn with KL-relaxed marginals (``reach``, ``reach_x``, ``reach_y``), JAX.

The twin of ``torch_api.samples_loss_ops`` with ``rho_x`` / ``rho_y``; the definition (flash-
sinkhorn 0.4.1's, GeomLoss's for ``reach``) is stated in torch_api/samples_loss.py, the formulas
live in ``core.unbalanced``:

* the loop is GeomLoss's (``loops.geomloss_solve``) for each of OT(a, b), OT(a, a), OT(b, b),
  with rho_x on the first and rho_y on the second marginal of each: every softmin of a
  first-side potential (f_ba, p_a, p_b) multiplied by damping(eps, rho_x) = 1 / (1 + eps / rho_x),
  of a second-side one (g_ab, q_a, q_b) by damping(eps, rho_y), at each eps of the schedule
  (initialisation and last extrapolation included); a strict side (rho None) is not damped.
  With rho_x == rho_y the self problems keep one potential (p = q: GeomLoss's f_aa, g_bb);
  otherwise f_aa = [p_a, q_a], g_bb = [p_b, q_b]. With exactly one relaxed marginal each
  problem is translated after every update (``unbalanced.semi_unbalanced_translate``);
* ``terms``: the outputs are the per-point dual terms of the loss,
  F = w_x(f_ba) - (w_x(p_a) + w_y(q_a))/2 (= w_x(f_ba) - w_x(f_aa) when p = q; debias) or
  w_x(f_ba), w = ``unbalanced.geomloss_weight`` (the potential itself on a strict side), so
  that the loss is <a, F> + <b, G>; otherwise the damped potentials f_ba - (p_a + q_a)/2,
  g_ab - (p_b + q_b)/2 (debias) or (f_ba, g_ab);
* derivative (GeomLoss's autograd of its last extrapolation, inputs and translation detached):

      dF_i/dx_i = damp_x w_x'(f_ba_i) (x_i - (P y)_i)
                  - [damp_x w_x'(p_i) (x_i - (Q_q x)_i) + damp_y w_y'(q_i) (x_i - (Q_p x)_i)] / 2,

  w' = ``unbalanced.geomloss_weight_slope`` (1 for the potentials), P, Q_q, Q_p the
  row-normalised plans of the last extrapolation's f_ba, p, q updates (p = q: the self term is
  damp w'(f_aa) (x - Q x)); symmetrically in y; none in a, b (the loss's gradient in a is F, as
  GeomLoss's). Second derivatives in x, y: the Jacobian of this gradient field at the fixed
  point, OTT's relaxed costs' Hessians with per-side factors (``core.unbalanced.
  geomloss_hessian_sides``; c times the Hessian of OTT's relaxed divergence with ``reach``); a
  ``jax.jvp`` of ``jax.grad`` applies it, not its transpose (they differ with reach_x != reach_y);
  those of the potentials raise NotImplementedError.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jax.custom_derivatives import SymbolicZero

from ..core.unbalanced import (
    geomloss_hessian_sides, geomloss_weight, geomloss_weight_slope, self_problems_split, semi_unbalanced_translate,
)
from . import geomloss_schedule as schedule
from . import kernel_ops
from .batching import loop_over_batch
from .derivatives import loss_hessian_rows
from .implicit import ImplicitConfig
from .kernel_ops import F32, Cloud, make_params, masked_log
from .label_inputs import pair_clouds
from .geomloss_packed import vmappable
from .loops import GEOMLOSS_SCALE, dense_softmins


@dataclass(frozen=True)
class RelaxedConfig:
    """Static options of a relaxed GeomLoss solve (hashable: a jit static argument)."""
    debias: bool
    precision: str
    backend: str | None
    rho_x: float | None
    rho_y: float | None
    terms: bool


def _damp(eps, rho_):
    """damping(eps, rho) for a traced eps (None: strict, no factor)."""
    return None if rho_ is None else rho_ / (rho_ + eps)


def damped_solve(cfg: RelaxedConfig, X: Cloud, Y: Cloud, la, lb, eps_at, n_eps, last_eps, softmins=None):
    """(old, new) potential quadruples (f_ba, g_ab, f_aa, g_bb) around the last extrapolation
    of the damped loop (module docstring); f_aa, g_bb stay zero without ``debias``, and hold
    [p_a, q_a], [p_b, q_b] when the self problems are split (rho_x != rho_y). ``softmins``: the
    (pair, own) of ``loops.dense_softmins`` (default), or a packed batch's (``geomloss_packed``;
    unsplit self problems only)."""
    kw = dict(precision=cfg.precision, backend=cfg.backend)
    rhos = (cfg.rho_x, cfg.rho_y)
    split = cfg.debias and self_problems_split(*rhos)
    pair, own = softmins or dense_softmins(X, Y, la, lb, cfg.precision, cfg.backend)

    def damp(t, side, eps):
        d = _damp(jnp.asarray(eps, F32), rhos[side])
        return t if d is None else d * t

    def self_split(S, pq, lw, prm, eps):  # p <- softmin(q) damped with rho_x, q <- softmin(p) with rho_y
        p, q = kernel_ops.lse_pair(S, S, pq[:S.n], pq[S.n:], lw, lw, prm, **kw)
        return jnp.concatenate((damp(p, 0, eps), damp(q, 1, eps)))

    def sweep(pots, eps):
        prm = make_params(eps, GEOMLOSS_SCALE)
        f_ba, g_ab, f_aa, g_bb = pots
        f, g = pair(f_ba, g_ab, prm)
        out = [damp(f, 0, eps), damp(g, 1, eps), f_aa, g_bb]
        if split:
            out[2], out[3] = self_split(X, f_aa, la, prm, eps), self_split(Y, g_bb, lb, prm, eps)
        elif cfg.debias:
            out[2], out[3] = damp(own(0, f_aa, prm), 0, eps), damp(own(1, g_bb, prm), 1, eps)
        return tuple(out)

    def translate(pots):  # exactly one relaxed marginal: every problem along (f + c, g - c)
        if (cfg.rho_x is None) == (cfg.rho_y is None):
            return pots
        f_ba, g_ab, f_aa, g_bb = pots
        out = list(semi_unbalanced_translate(jnp, f_ba, g_ab, la, lb, *rhos)) + [f_aa, g_bb]
        if cfg.debias:
            for i, S, lw in ((2, X, la), (3, Y, lb)):
                out[i] = jnp.concatenate(semi_unbalanced_translate(jnp, out[i][:S.n], out[i][S.n:], lw, lw, *rhos))
        return tuple(out)

    k = 2 if split else 1
    zeros = (jnp.zeros(X.n, F32), jnp.zeros(Y.n, F32), jnp.zeros(k * X.n, F32), jnp.zeros(k * Y.n, F32))
    pots = translate(sweep(zeros, eps_at(0)))

    def body(i, pots):
        new = sweep(pots, eps_at(i))
        return translate(tuple(0.5 * (p + q) for p, q in zip(pots, new)))

    pots = jax.lax.fori_loop(0, n_eps, body, pots)
    return pots, translate(sweep(pots, last_eps))


def _outputs(cfg: RelaxedConfig, new, eps):
    f_ba, g_ab, f_aa, g_bb = new
    w = (lambda p, r: geomloss_weight(jnp, p, r, eps)) if cfg.terms else (lambda p, r: p)
    if not cfg.debias:
        return w(f_ba, cfg.rho_x), w(g_ab, cfg.rho_y)
    out = []
    for cross, own, rho_ in ((f_ba, f_aa, cfg.rho_x), (g_ab, g_bb, cfg.rho_y)):
        if self_problems_split(cfg.rho_x, cfg.rho_y):  # own = [p, q]: 1/2 (w_x(p) + w_y(q))
            n = cross.shape[0]
            out.append(w(cross, rho_) - 0.5 * (w(own[:n], cfg.rho_x) + w(own[n:], cfg.rho_y)))
        else:
            out.append(w(cross, rho_) - w(own, rho_))
    return tuple(out)


def _forward(cfg: RelaxedConfig, x, y, a, b, sched, labels=None):
    sg = jax.lax.stop_gradient
    X, Y = pair_clouds(sg(x), sg(y), labels, cfg.backend)
    a, b, sched = sg(a), sg(b), sg(sched)
    la, lb = masked_log(a), masked_log(b)

    def run(X, Y, la, lb, sched, softmins):
        return damped_solve(cfg, X, Y, la, lb, lambda k: schedule.eps_at(sched, k), schedule.n_eps(sched),
                            schedule.last_eps(sched), softmins)

    # under vmap: one packed loop for the batch when both marginals are relaxed alike (each problem's
    # potentials its own, no translation), else one annealed loop per problem
    if cfg.rho_x == cfg.rho_y:
        solve = vmappable(run, cfg.precision, cfg.backend)
    else:
        solve = loop_over_batch(lambda *v: run(*v, None))
    old, new = solve(X, Y, la, lb, sched)
    eps = schedule.last_eps(sched)
    return _outputs(cfg, new, eps), (X, Y, la, lb, old, new, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def relaxed_outputs(cfg: RelaxedConfig, x, y, a, b, sched, labels=None):
    """(F, G) of one problem (module docstring); derivative in x, y by GeomLoss's rule, none in
    a, b, sched (nor in ``labels``: (label_x, label_y, W) of a labelled cost, :mod:`.label_inputs`)."""
    return _forward(cfg, x, y, a, b, sched, labels)[0]


def _side(cfg: RelaxedConfig, S: Cloud, T: Cloud, f, g_w, h, oh, lw, prm, eps, rho_):
    """dF_i/dx_i for the rows of S (module docstring); ``g_w``: the other side's old potential with
    eps log w folded in, so that P is GeomLoss's softmax weights; ``h``, ``oh``: the self problem's
    new and old potentials (split: [p, q]), ``lw`` the log weights of S."""
    kw = dict(precision=cfg.precision, backend=cfg.backend)

    def term(pot, r, mean):
        d = _damp(eps, r)
        slope = geomloss_weight_slope(jnp, pot, r, eps)[:, None] if cfg.terms else 1.0
        return (1.0 if d is None else d) * slope * (S.x - mean)

    def mean(src, tgt, row, col_w):
        pv, r = kernel_ops.apply_plan(src, tgt, row, col_w, prm, v=tgt.x, **kw)
        return pv / r[:, None]

    row = term(f, rho_, mean(S, T, f, g_w))
    if not cfg.debias:
        return row
    if not self_problems_split(cfg.rho_x, cfg.rho_y):
        return row - term(h, rho_, mean(S, S, h, oh + eps * lw))
    n = S.n
    p, q, op, oq = h[:n], h[n:], oh[:n], oh[n:]
    return row - 0.5 * (term(p, cfg.rho_x, mean(S, S, p, oq + eps * lw))
                        + term(q, cfg.rho_y, mean(S, S, q, op + eps * lw)))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def relaxed_grads(cfg: RelaxedConfig, x, y, uF, uG, saved):
    """(uF dF/dx, uG dG/dy) at the saved solve (``x``, ``y`` only carry tangents: the kernels read
    the centred clouds of ``saved``). Its JVP: dF_i/dx_i = (1 / a_i) G_x,i, G the gradient field of
    ``unbalanced.geomloss_hessian_sides``, so it is (uF / a) J t, J the Jacobian of G
    (``derivatives.loss_hessian_rows``); for the potentials it raises."""
    dx, dy = _directions(cfg, saved)
    return uF[:, None] * dx, uG[:, None] * dy


def _directions(cfg: RelaxedConfig, saved):
    """(dF/dx, dG/dy) row by row at the saved solve (module docstring)."""
    X, Y, la, lb, old, new, eps = saved
    f_ba, g_ab, f_aa, g_bb = new
    of_ba, og_ab, of_aa, og_bb = old
    prm = make_params(eps, GEOMLOSS_SCALE)
    dx = _side(cfg, X, Y, f_ba, og_ab + eps * lb, f_aa, of_aa, la, prm, eps, cfg.rho_x)
    dy = _side(cfg, Y, X, g_ab, of_ba + eps * la, g_bb, og_bb, lb, prm, eps, cfg.rho_y)
    return dx, dy


def _relaxed_grads_jvp(cfg: RelaxedConfig, primals, tangents):
    x, y, uF, uG, saved = primals
    tx, ty, tuF, tuG, _ = tangents
    zero = lambda t: t is None or isinstance(t, SymbolicZero)
    geomloss_hessian_sides(cfg.rho_x, cfg.rho_y, 1.0, cfg.terms)  # raises where not implemented
    saved = jax.tree.map(jax.lax.stop_gradient, saved)
    dx, dy = _directions(cfg, saved)
    out = uF[:, None] * dx, uG[:, None] * dy
    res_x, res_y = jnp.zeros_like(out[0]), jnp.zeros_like(out[1])
    if not (zero(tuF) and zero(tuG)):
        res_x = res_x if zero(tuF) else tuF[:, None] * dx
        res_y = res_y if zero(tuG) else tuG[:, None] * dy
    if not (zero(tx) and zero(ty)):
        hx, hy = loss_hessian_rows(saved, None if zero(tx) else tx, None if zero(ty) else ty, uF, uG,
                                   ImplicitConfig(cfg.precision, cfg.backend), cfg.debias, (cfg.rho_x, cfg.rho_y))
        res_x, res_y = res_x + hx, res_y + hy
    return out, (res_x, res_y)


relaxed_grads.defjvp(_relaxed_grads_jvp, symbolic_zeros=True)


def _fwd(cfg: RelaxedConfig, x, y, a, b, sched, labels=None):
    out, saved = _forward(cfg, x, y, a, b, sched, labels)
    return out, (x, y, saved)


def _bwd(cfg: RelaxedConfig, res, cts):
    x, y, saved = res
    uF, uG = cts
    gx, gy = relaxed_grads(cfg, x, y, uF, uG, saved)
    return (gx, gy, None, None, None, None)  # GeomLoss detaches the weights and the schedule


relaxed_outputs.defvjp(_fwd, _bwd)
