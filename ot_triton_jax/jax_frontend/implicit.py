"""JAX rules of implicit differentiation: HVPs, Hessians and derivatives of the potentials.

The math is :mod:`ot_triton_jax.core.implicit_derivatives` (written once, also run by
``torch_api``); this module gives it JAX's idioms:

* :func:`gradients` -- the envelope gradient (gx, gy, ga, gb) of reg_ot_cost as a
  ``jax.custom_jvp`` whose JVP is the Hessian applied to the tangent (the CG solve), so
  ``jax.jvp(jax.grad(f))``, ``jax.hessian`` and ``jax.vmap`` of HVPs work on any loss built
  from ``reg_ot_cost`` (``sinkhorn_divergence`` included). The potentials passed in are
  taken as the solution for the other inputs (their own tangents are ignored).
* :func:`eps_scale_gradients` -- d/d eps and d/d s; differentiating them again raises.
* :func:`potentials` -- the identity on (f, g) with the implicit VJP (``out.f``, ``out.g``).
* :func:`transport` -- P v with its VJP in x, y, f, g, v (``out.apply``, ``out.marginal``).

Derivatives that involve epsilon or scale_cost beyond the first order of reg_ot_cost
raise ``NotImplementedError``. With a KL-relaxed marginal (``ImplicitConfig.taus`` not
(1, 1), OTT's tau_a / tau_b < 1) the first derivatives of reg_ot_cost are those of OTT's
unbalanced cost at fixed potentials (:func:`envelope`); the JVP of :func:`gradients` along x, y
and the implicit VJP of the potentials (hence of ``apply`` / ``marginal`` through them) solve
the relaxed system (core.implicit_solve, core.implicit_derivatives); tangents in a, b of the
gradient raise ``NotImplementedError``. With a label cost (``labels`` = (label_x, label_y,
label_cost), :mod:`.label_inputs`) the first derivatives of reg_ot_cost in x, y, a, b, eps, s are
exact (the label term does not depend on x, y; sum P W enters d/d eps and d/d s), the others raise
``NotImplementedError``. CG options travel in :class:`ImplicitConfig`; when CG
stops unconverged a ``RuntimeWarning`` is issued from the device (``jax.debug.callback``).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ..core import implicit_derivatives as imp, unbalanced
from ..core.implicit_solve import ImplicitOptions, check_no_eps_tangent, unconverged_message
from . import kernel_ops
from .envelope_grads import CostGrads, cost_grads
from .kernel_ops import make_params
from .label_inputs import check_unlabelled, pair_clouds

sg = jax.lax.stop_gradient


@dataclass(frozen=True)
class ImplicitConfig:
    """Static configuration of the derivative passes: kernel precision, launcher, CG options, and
    OTT's (tau_a, tau_b) of the problem ((1, 1): balanced)."""

    precision: str = "float32"
    backend: str | None = None
    options: ImplicitOptions = field(default_factory=ImplicitOptions)
    taus: tuple[float, float] = (1.0, 1.0)
    symmetric: bool = False  # a self problem (x = y, a = b, tau_a = tau_b): its HVPs solve the symmetric system

    @property
    def balanced(self) -> bool:
        return unbalanced.is_balanced(*self.taus)


class Passes:
    """The streaming passes of one plan on JAX arrays (core.implicit_solve.PlanPasses)."""

    xp = jnp

    def __init__(self, X, Y, f, g, eps, s, cfg: ImplicitConfig):
        self.X, self.Y, self.f, self.g, self.cfg = X, Y, sg(f), sg(g), cfg
        self.x, self.y, self.n, self.m = X.x, Y.x, X.n, Y.n
        self.eps, self.s = sg(jnp.asarray(eps, jnp.float32)), sg(jnp.asarray(s, jnp.float32))
        self.prm = make_params(self.eps, self.s)

    @classmethod
    def of(cls, x, y, f, g, eps, s, cfg: ImplicitConfig, labels=None) -> "Passes":
        return cls(*pair_clouds(sg(x), sg(y), labels, cfg.backend), f, g, eps, s, cfg)

    def _kw(self):
        return dict(precision=self.cfg.precision, backend=self.cfg.backend)

    def apply(self, v):
        return kernel_ops.apply_plan(self.X, self.Y, self.f, self.g, self.prm, v=v, **self._kw())

    def apply_t(self, u):
        return kernel_ops.apply_plan(self.Y, self.X, self.g, self.f, self.prm, v=u, **self._kw())

    def apply_t_sq(self, u):
        half = make_params(0.5 * self.eps, self.s)  # P_ij^2 is the plan at eps / 2
        return kernel_ops.apply_plan(self.Y, self.X, self.g, self.f, half, v=u[:, None], **self._kw())[0][:, 0]

    def weighted(self, w, A, B):
        return kernel_ops.apply_weighted(self.X, self.Y, self.f, self.g, self.prm, w, A, B, **self._kw())

    def weighted_t(self, w, A, B):
        return kernel_ops.apply_weighted(self.Y, self.X, self.g, self.f, self.prm, w, A, B, **self._kw())

    def transposed(self) -> "Passes":
        return Passes(self.Y, self.X, self.g, self.f, self.eps, self.s, self.cfg)

    @staticmethod
    def while_loop(cond, body, state):
        return jax.lax.while_loop(cond, body, state)


def _warn_host(ok, k, rel, what):
    ok, k, rel = np.asarray(ok), np.asarray(k), np.asarray(rel)
    if not np.all(ok):
        warnings.warn(unconverged_message(what, int(np.max(k)), float(np.max(rel))), RuntimeWarning, stacklevel=2)


def warn_unconverged(info, cfg: ImplicitConfig, what: str) -> None:
    if cfg.options.warn:
        k, rel, ok = info
        jax.debug.callback(functools.partial(_warn_host, what=what), ok, k, rel)


def _zero(t) -> bool:
    return t is None or isinstance(t, SymbolicZero)


def _or_none(t):
    return None if _zero(t) else t


# ----------------------------------------------------------------------------- gradient map


def envelope(cfg: ImplicitConfig, x, y, a, b, eps, s, f, g, labels=None) -> CostGrads:
    """The gradient of reg_ot_cost at fixed (f, g): kernel_ops.cost_grads (balanced); with a
    relaxed marginal its a, b and eps entries are those of OTT's unbalanced cost
    (core.unbalanced.ott_cost_partials), x, y and s are unchanged."""
    X, Y = pair_clouds(sg(x), sg(y), labels, cfg.backend)
    a, b, eps, f, g = sg(a), sg(b), sg(eps), sg(f), sg(g)
    gr = cost_grads(X, Y, a, b, eps, sg(s), f, g, precision=cfg.precision, backend=cfg.backend)
    if cfg.balanced:
        return gr
    ga, gb, geps = unbalanced.ott_cost_partials(jnp, f, g, a, b, eps, *cfg.taus)
    geps_balanced = unbalanced.ott_cost_partials(jnp, f, g, a, b, eps, 1.0, 1.0)[2]  # in gr.eps: swap it
    return gr._replace(a=ga, b=gb, eps=gr.eps - geps_balanced + geps)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def gradients(cfg: ImplicitConfig, x, y, a, b, eps, s, f, g, labels=None):
    """(gx, gy, ga, gb): the envelope gradient of reg_ot_cost at the solution (f, g);
    its JVP is the Hessian applied to (tx, ty, ta, tb) (core.implicit_derivatives; raises with
    ``labels``)."""
    gr = envelope(cfg, x, y, a, b, eps, s, f, g, labels)
    return gr.x, gr.y, gr.a, gr.b


def hessian_apply(cfg: ImplicitConfig, x, y, a, b, eps, s, f, g, tangents, want=(True,) * 4, symmetric=False):
    """((tx, ty, ta, tb), info): the Hessian of reg_ot_cost applied to ``tangents``
    (``symmetric``: a self problem moved as one cloud, core.implicit_derivatives.hessian_apply)."""
    ops = Passes.of(x, y, f, g, eps, s, cfg)
    out, info = imp.hessian_apply(ops, sg(f), sg(g), sg(a), sg(b), tangents, want, cfg.options, cfg.taus, symmetric)
    warn_unconverged(info, cfg, "HVP of reg_ot_cost")
    return out, info


def _gradients_jvp(cfg, primals, tangents):
    x, y, a, b, eps, s, f, g, labels = primals
    check_no_eps_tangent("jax.jvp of the gradient of reg_ot_cost", not (_zero(tangents[4]) and _zero(tangents[5])))
    check_unlabelled(labels, "A second derivative (HVP, jax.hessian) of reg_ot_cost")
    out = gradients(cfg, x, y, a, b, eps, s, f, g)
    tans = tuple(_or_none(t) for t in tangents[:4])
    if all(t is None for t in tans):
        return out, tuple(jnp.zeros_like(o) for o in out)
    if cfg.symmetric and tans[0] is not None and tans[2] is None and tans[3] is None:
        # x is y: the two tangents are one (core.implicit_derivatives.hessian_apply, symmetric)
        res, _ = hessian_apply(cfg, x, y, a, b, eps, s, f, g, (tans[0], tans[0], None, None), symmetric=True)
    else:
        res, _ = hessian_apply(cfg, x, y, a, b, eps, s, f, g, tans)
    return out, tuple(jnp.zeros_like(o) if t is None else t.astype(o.dtype) for o, t in zip(out, res))


gradients.defjvp(_gradients_jvp, symbolic_zeros=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def eps_scale_gradients(cfg: ImplicitConfig, x, y, a, b, eps, s, f, g, labels=None):
    """(d/d eps, d/d s) of reg_ot_cost at fixed potentials; its derivatives raise."""
    gr = envelope(cfg, x, y, a, b, eps, s, f, g, labels)
    return gr.eps, gr.s


@eps_scale_gradients.defjvp
def _eps_scale_jvp(cfg, primals, tangents):
    check_no_eps_tangent("a second derivative of reg_ot_cost through epsilon or scale_cost", True)


# ----------------------------------------------------------------------------- potentials


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def potentials(cfg: ImplicitConfig, x, y, a, b, eps, s, f, g, labels=None):
    """(f, g) -- the solved potentials passed in -- with the implicit VJP in x, y, a, b
    (core.implicit_derivatives.potentials_vjp; the gauge is stated there; raises with ``labels``)."""
    return f, g


def _values(tree):
    return jax.tree.map(lambda p: p.value, tree)


def _potentials_fwd(cfg, x, y, a, b, eps, s, f, g, labels=None):
    eps_flag = None if not (eps.perturbed or s.perturbed) else jnp.zeros(())
    vals = tuple(v.value for v in (x, y, a, b, eps, s, f, g))
    return vals[6:], vals + (eps_flag, None if _values(labels) is None else jnp.zeros(()))


def _potentials_bwd(cfg, res, cts):
    x, y, a, b, eps, s, f, g, eps_flag, labelled = res
    uf, ug = (_or_none(c) for c in cts)
    if uf is None and ug is None:
        return (None,) * 9
    check_no_eps_tangent("the gradient of a function of the potentials", eps_flag is not None)
    check_unlabelled(labelled, "The derivative of the potentials f, g")
    ops = Passes.of(x, y, f, g, eps, s, cfg)
    (tx, ty, ta, tb), info = imp.potentials_vjp(ops, sg(f), sg(g), sg(a), sg(b), uf, ug, (True,) * 4,
                                                cfg.options, cfg.taus)
    warn_unconverged(info, cfg, "VJP of the potentials")
    return tx, ty, ta, tb, None, None, None, None, None


potentials.defvjp(_potentials_fwd, _potentials_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------- P v


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def transport(cfg: ImplicitConfig, src, tgt, f_src, g_tgt, eps, s, v, labels=None):
    """P v (rows of P = ``src``; v (m, k)), differentiable in src, tgt, f_src, g_tgt, v (raises with
    ``labels`` = (label_src, label_tgt, W oriented (K_src, K_tgt)))."""
    ops = Passes.of(src, tgt, f_src, g_tgt, eps, s, cfg, labels)
    return ops.apply(sg(v))[0]


def _transport_fwd(cfg, src, tgt, f, g, eps, s, v, labels=None):
    eps_flag = None if not (eps.perturbed or s.perturbed) else jnp.zeros(())
    vals = tuple(t.value for t in (src, tgt, f, g, eps, s, v))
    labels = _values(labels)
    return transport(cfg, *vals, labels), vals + (eps_flag, None if labels is None else jnp.zeros(()))


def _transport_bwd(cfg, res, ct):
    src, tgt, f, g, eps, s, v, eps_flag, labelled = res
    if _zero(ct):
        return (None,) * 8
    check_no_eps_tangent("the gradient of apply / marginal", eps_flag is not None)
    check_unlabelled(labelled, "The derivative of apply / marginal")
    ops = Passes.of(src, tgt, f, g, eps, s, cfg)
    dx, dy, df, dg, dv = imp.apply_vjp(ops, sg(v), ct)
    return dx, dy, df, dg, None, None, dv, None


transport.defvjp(_transport_fwd, _transport_bwd, symbolic_zeros=True)
