"""``samples_loss(..., backend="multiscale")`` in JAX (d <= 3): the twin of torch_api's.

The algorithm, its options and its conventions are those of
``torch_api.SamplesLoss(backend="multiscale")`` (``ot_triton_jax.core.multiscale_rules`` states
them): clusters, truncation by a rigorous bound, block-sparse fine sweeps, finishing to a
marginal-error ``tol``. It is written once: the solve (``torch_api.multiscale.solve.anneal``), the
gradient rule (``torch_api.multiscale.gradient.direction``) and the HVP (``torch_api.multiscale.hvp``) run on the JAX arrays
through zero-copy DLPack views (``interop.to_torch`` / ``from_torch``), on the same device and the
same kernels.

Eager only: the block lists have data-dependent sizes (clusters, runs), so this backend cannot be
traced: inside ``jax.jit`` or ``jax.vmap`` it raises (use the default backend there). Eagerly,
``jax.grad`` works (custom_vjp: GeomLoss's gradient rule in x, y; grad_a = F, grad_b = G), and so
does the HVP as forward-over-reverse, ``jax.jvp(jax.grad(f), (x,), (v,))`` (custom_jvp of the
gradient: the Hessian of the converged loss at blur^2 on the kept blocks, as the torch double
backward); reverse-over-reverse raises. :func:`last_multiscale_report` returns the last call's
report (clusters, kept fraction, sweeps, marginal error, convergence, dropped-mass bound).
Relaxed marginals (``MultiscaleConfig.relax``: ``reach``, or OTT's tau_a / tau_b from
``sinkhorn_multiscale``) as torch_api's: the HVP of the loss with ``reach`` (c times OTT's relaxed
Hessian, ``torch_api.multiscale.hvp.hessian_relaxation``); with tau_a / tau_b it raises.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from ..core import multiscale_rules as rules
from .interop import concrete_value, from_torch, is_tracer, to_torch
from .kernel_ops import F32

__all__ = ["multiscale_samples_loss", "last_multiscale_report"]

_LAST: dict = {}


class MultiscaleConfig(NamedTuple):
    blur: float
    scaling: float
    diameter: float
    cluster_scale: float | None
    truncate: float | None
    tol: float | None
    debias: bool
    precision: str
    relax: tuple | None = None  # None, or (rho_x, rho_y, mode): torch_api.multiscale.samples_loss.relaxed_outputs


def last_multiscale_report() -> dict:
    """The report of the last eager ``samples_loss(..., backend="multiscale")`` call: clusters
    (K_x, K_y), kept (fraction of the x-y cluster pairs streamed), sweeps and finish_sweeps on
    the points, taylor_passes (the plan updates the Taylor pass made, torch_api.multiscale.taylor),
    marginal_error (None without tol), converged, dropped_mass_bound (the loss is within eps times
    it of the untruncated last extrapolation)."""
    return dict(_LAST)


def _jax(t):
    if t is None:
        return None
    try:
        return from_torch(t)
    except ValueError:  # an offset view or an unaligned buffer: copy
        return from_torch(t, copy=True)


@jax.tree_util.register_pytree_node_class
class _Held:
    """The torch solve's state (``MultiscaleResult.state``: clouds, ranges, masks, potentials) as it
    is, carried from the forward to the backward and the HVP as pytree metadata without leaves.
    This backend runs eagerly only (it raises under tracing), so no transformation needs the state as
    arrays; converting its ~70 tensors to JAX arrays and back (DLPack, ~0.25 ms each, plus copies of
    the int64 / bool ones) costs ~20 ms of a 2^18 call on the H100. Identity hash and
    equality (object's): two solves never compare equal."""

    def __init__(self, state, coefs=None):
        self.state, self.coefs = state, coefs  # coefs: the relaxed gradient's (side x, side y) factors

    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, held, children):
        return held


def _concrete(v):
    c = concrete_value(v)
    if c is None:
        raise NotImplementedError(TRACED)
    return jnp.asarray(c)


TRACED = ("backend='multiscale' runs eagerly: its block lists have data-dependent sizes, so it cannot be "
          "traced by jax.jit or jax.vmap. Call it outside jit/vmap (jax.grad and jax.jvp(jax.grad(f)) work "
          "eagerly), or use the default backend inside jit")


def _forward(cfg: MultiscaleConfig, x, y, a, b, means=(False, False)):
    from torch_api.multiscale.samples_loss import relaxed_coefs, relaxed_outputs
    from torch_api.multiscale.solve import anneal
    tx, ty, ta, tb = (to_torch(_concrete(v)) for v in (x, y, a, b))
    rho = (None, None) if cfg.relax is None else cfg.relax[:2]
    res = anneal(tx, ty, ta, tb, cfg.blur, cfg.scaling, cfg.diameter, cluster_scale=cfg.cluster_scale,
                 truncate=cfg.truncate, debias=cfg.debias, precision=cfg.precision, tol=cfg.tol, means=means,
                 rho=rho)
    _LAST.clear()
    _LAST.update(clusters=res.clusters, kept=res.kept, sweeps=res.sweeps, finish_sweeps=res.finish_sweeps,
                 taylor_passes=res.taylor_passes, marginal_error=res.marginal_error, converged=res.converged,
                 dropped_mass_bound=res.dropped_mass_bound)
    f_ba, g_ab, f_aa, g_bb = res.new
    if cfg.relax is not None:
        F, G = relaxed_outputs(res, cfg.debias, cfg.relax)
        coefs = tuple(relaxed_coefs(res, k, cfg.relax) for k in (0, 1))
        return (_jax(F.contiguous()), _jax(G.contiguous())), _Held(res.state, coefs)
    F, G = (f_ba - f_aa, g_ab - g_bb) if cfg.debias else (f_ba, g_ab)
    return (_jax(F.contiguous()), _jax(G.contiguous())), _Held(res.state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def multiscale_potentials(cfg: MultiscaleConfig, x, y, a, b):
    """(F, G) of one problem (float32); derivatives in x, y by GeomLoss's rule, none in a, b."""
    return _forward(cfg, x, y, a, b)[0]


def _potentials_fwd(cfg, x, y, a, b):
    # symbolic_zeros: x.perturbed / y.perturbed say which gradients are asked for (the backward
    # then streams only those sides, as torch's needs_input_grad)
    out, saved = _forward(cfg, x.value, y.value, a.value, b.value, (x.perturbed, y.perturbed))
    want = jnp.array([x.perturbed, y.perturbed])
    # x, y themselves (not their values): under jax.jvp(jax.grad(f)) their tangents reach
    # multiscale_grads' JVP, the HVP
    return out, (x.value, y.value, _concrete(a.value), _concrete(b.value), want, saved)


def _potentials_bwd(cfg, resid, cts):
    x, y, a, b, want, saved = resid
    uF, uG = (jnp.zeros_like(t) if isinstance(t, SymbolicZero) else t for t in cts)
    sides = tuple(bool(w) for w in want)
    gx, gy = multiscale_grads(cfg, sides, x, y, a, b, uF, uG, saved)
    return (gx if sides[0] else None), (gy if sides[1] else None), None, None


multiscale_potentials.defvjp(_potentials_fwd, _potentials_bwd, symbolic_zeros=True)


def _directions(cfg, sides, saved):
    """(dF/dx, dG/dy) of the sides asked for (zeros for the others)."""
    from torch_api.multiscale.gradient import direction
    plans = saved.state[1]
    coefs = saved.coefs or (None, None)
    return tuple(_jax(direction(saved, k, cfg.debias, cfg.precision, coefs[k]).contiguous()) if sides[k] else
                 jnp.zeros(tuple(plans[name][0].x.shape), F32) for k, name in ((0, "xy"), (1, "yx")))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def multiscale_grads(cfg: MultiscaleConfig, sides: tuple, x, y, a, b, uF, uG, saved):
    """(uF dF/dx, uG dG/dy) at the saved solve, for the ``sides`` asked for (x, y: bools; zeros
    otherwise); ``x``, ``y`` only carry tangents. Its JVP in (x, y) is the HVP: dF_i/dx_i =
    (1/a_i) dS/dx_i, so a tangent (tx, ty) of the points adds uF / a * (H (tx, ty))_x (and
    likewise for y), H from ``torch_api.multiscale.hvp``."""
    dx, dy = _directions(cfg, sides, saved)
    return uF[:, None] * dx, uG[:, None] * dy


def _grads_jvp(cfg, sides, primals, tangents):
    from torch_api.multiscale.hvp import multiscale_hvp
    x, y, a, b, uF, uG, saved = primals
    tx, ty, _, _, tuF, tuG, _ = tangents
    out = multiscale_grads(cfg, sides, x, y, a, b, uF, uG, saved)
    zero = lambda t: t is None or isinstance(t, SymbolicZero)  # noqa: E731
    res_x, res_y = jnp.zeros_like(out[0]), jnp.zeros_like(out[1])
    if not (zero(tuF) and zero(tuG)):
        dx, dy = _directions(cfg, sides, saved)
        res_x = res_x if zero(tuF) else tuF[:, None] * dx
        res_y = res_y if zero(tuG) else tuG[:, None] * dy
    if not (zero(tx) and zero(ty)):
        if any(is_tracer(t) for t in (tx, ty, uF, uG) if not zero(t)):
            raise NotImplementedError("the HVP of samples_loss(backend='multiscale') runs eagerly as "
                                      "forward-over-reverse, jax.jvp(jax.grad(f), (x,), (v,)); reverse-over-"
                                      "reverse (jax.grad of a gradient) and traced tangents are not supported")
        vx = None if zero(tx) else to_torch(jnp.asarray(tx, F32))
        vy = None if zero(ty) else to_torch(jnp.asarray(ty, F32))
        hx, hy = multiscale_hvp(saved, vx, vy, cfg.debias, cfg.precision, relax=cfg.relax)
        hx, hy = _jax(hx.contiguous()), _jax(hy.contiguous())
        if sides[0]:
            res_x = res_x + jnp.where(a > 0, uF / jnp.where(a > 0, a, 1.0), 0.0)[:, None] * hx
        if sides[1]:
            res_y = res_y + jnp.where(b > 0, uG / jnp.where(b > 0, b, 1.0), 0.0)[:, None] * hy
    return out, (res_x, res_y)


multiscale_grads.defjvp(_grads_jvp, symbolic_zeros=True)


def multiscale_samples_loss(x, y, a, b, *, blur: float, scaling: float, diameter: float | None, cluster_scale,
                            truncate, tol, debias: bool, potentials: bool, precision: str, out_dtype,
                            relax: tuple | None = None):
    """The value (or (F, G)) of one problem x (N, D), y (M, D), D <= 3, checked inputs. ``relax``:
    None, or (rho_x, rho_y, mode) (KL-relaxed marginals; mode as torch_api's relaxed_outputs: the
    potentials, the loss's per-point terms, or OTT's envelope)."""
    for v in (x, y, a, b):
        _concrete(v)
    if x.ndim == 3:
        raise NotImplementedError("backend='multiscale' solves one problem at a time: pass x (N, D), y (M, D), "
                                  "or use the default backend for batches")
    rules.check_dim(x.shape[-1])
    truncate, tol = rules.truncate_value(truncate), rules.tol_value(tol)
    if cluster_scale is not None:
        rules.cluster_scale_value(cluster_scale, 1.0, 1)  # positive and finite, or an error naming it
    if diameter is None:  # torch_api's float64 bounding-box diagonal, on the same values
        from torch_api.samples_loss_ops import diameter as bounding_diameter
        diameter = bounding_diameter(to_torch(_concrete(x)), to_torch(_concrete(y))) or blur
    cfg = MultiscaleConfig(float(blur), float(scaling), float(diameter), cluster_scale, truncate, tol,
                           bool(debias), precision, relax)
    F, G = multiscale_potentials(cfg, x.astype(F32), y.astype(F32), a.astype(F32), b.astype(F32))
    F, G = F.astype(out_dtype), G.astype(out_dtype)
    if potentials:
        return F, G
    return jnp.sum(a.astype(out_dtype) * F) + jnp.sum(b.astype(out_dtype) * G)
