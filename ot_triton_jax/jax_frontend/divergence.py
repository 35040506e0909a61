"""``ot_triton_jax.sinkhorn_divergence``: the debiased Sinkhorn divergence, OTT-JAX conventions.

The JAX twin of ``torch_api.sinkhorn_divergence``.

``sinkhorn_divergence`` follows ``ott.tools.sinkhorn_divergence.sinkhorn_divergence``
on ``PointCloud`` geometries (OTT 0.6.0)::

    div = R(x, y) - 1/2 R(x, x) - 1/2 R(y, y) + 1/2 eps (sum a - sum b)^2

with R = ``reg_ot_cost`` of ``ot_triton_jax.sinkhorn`` (C = |x - y|^2 / scale_cost,
absolute epsilon shared by the three terms). The (x, y) term is the alternating
solver; with ``symmetric_sinkhorn=True`` (OTT's default) the (x, x) and (y, y)
terms run OTT's symmetric solve (``parallel_dual_updates=True`` with momentum
0.5: h <- (h + T(h)) / 2, Feydy et al. 2019 eq. 25), whose marginal error is
||P 1 - a||_1 + ||P^T 1 - a||_1 and whose R uses an explicit plan-mass pass.
``static_b=True`` skips R(y, y) and uses ``offset_static_b`` (default 0) in its
place. The same ``threshold``/``inner_iterations``/``min_iterations``/
``max_iterations`` drive all solves (OTT's ``solve_kwargs``). Gradients in x, y,
a, b and epsilon: envelope theorem on each term (OTT's Danskin default), by the
``custom_vjp`` of :func:`.derivatives.reg_ot_cost`; second order (HVPs, ``jax.hessian``)
through its gradient's ``custom_jvp`` (each term's Hessian by streaming CG; the self
terms' with both clouds moving), with the CG options ``implicit``. The potentials of every term
have their problem's implicit VJP (:func:`.implicit.potentials`); a self term's in its one cloud
(the (x, x, a, a) problem's VJP with both sides' parts added; OTT's symmetric h as (f + g) / 2,
whose VJP has no gauge component).
Returns ``(divergence, SinkhornDivergenceOutput)`` like OTT.

Unbalanced (``tau_a`` / ``tau_b`` < 1, OTT's ``solve_kwargs=dict(tau_a=..., tau_b=...)``): the
three problems are OTT's LinearProblem(geom, ., ., tau_a, tau_b) (:func:`.sinkhorn`'s module
docstring); the (x, x) and (y, y) solves keep OTT's parallel updates with momentum 0.5, damped
by tau: with tau_a == tau_b f = g = h as above, with tau_a != tau_b f and g differ (both
updated from the old pair, the error the sum of both sides' relaxed errors). The masses may
differ and 1/2 eps (sum a - sum b)^2 (eps held fixed) is added as OTT does. First derivatives
as above; second derivatives in x, y as above (each term's with the relaxed implicit system);
tangents in a, b of the gradient raise ``NotImplementedError``.

Label costs (``label_x``, ``label_y``, ``label_cost`` W square and symmetric; :mod:`.label_inputs`): the (x, y)
term adds s W[label_x_i, label_y_j] to the cost, the (x, x) term s W[label_x_i, label_x_j], the
(y, y) term s W[label_y_i, label_y_j] (flash-sinkhorn's debiasing). First derivatives as above;
second derivatives raise ``NotImplementedError``.

Batching: ``jax.vmap`` works on every input (one kernel launch per problem).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ..core.implicit_solve import ImplicitOptions, implicit_options
from ..core.options import LoopOptions
from . import kernel_ops
from .checks import check_backend, check_iterations, inputs_ok
from .derivatives import KernelConfig, plan_mass, reg_ot_cost
from .implicit import potentials
from .kernel_ops import F32
from .label_inputs import checked, self_cloud, values_ok
from .leading_batch import is_batch, over_batch
from .batching import loop_over_batch
from ..core import unbalanced
from .batched_loop import vmappable_symmetric
from .loops import ott_params, parallel_solve
from .sinkhorn_solver import as_f32, check_problem, check_taus, solve_problem

__all__ = ["sinkhorn_divergence", "SinkhornDivergenceOutput"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["divergence", "a", "b", "potentials", "errors", "converged", "n_iters", "costs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SinkhornDivergenceOutput:
    """Details of :func:`sinkhorn_divergence` (a pytree), fields as OTT's.

    potentials, errors, converged, n_iters, costs: triples for the (x, y),
    (x, x) and (y, y) problems (the last entry is None with ``static_b``).
    ``costs`` are the three reg_ot_cost values.
    """

    divergence: jax.Array
    a: jax.Array
    b: jax.Array
    potentials: tuple
    errors: tuple
    converged: tuple
    n_iters: tuple
    costs: tuple


def _self_term(x32, a32, eps, scale, threshold, ok, opts: LoopOptions, backend, symmetric: bool,
               implicit: ImplicitOptions = ImplicitOptions(), taus=(1.0, 1.0), lx=None, w=None):
    """(reg_ot_cost, (f, g), errors, converged, n_iters) of the (x, x, a, a) problem (OTT's
    LinearProblem(geom_xx, a, a, tau_a, tau_b): with tau_a != tau_b, f != g); with a label cost
    (``lx``, ``w`` square) its cost adds s W[lx_i, lx_j]."""
    labels = None if w is None else (lx, lx, w)
    if not symmetric:
        out = solve_problem(x32, x32, a32, a32, eps, scale, threshold, None, opts, backend, implicit, taus, labels)
        return out.reg_ot_cost, (out.f, out.g), out.errors, out.converged, out.n_iters
    sg = jax.lax.stop_gradient
    s = 1.0 / scale
    X = self_cloud(sg(x32), lx, w, backend)
    prm = ott_params(sg(eps), sg(s), taus)
    a_s = sg(a32)
    h0 = jnp.where(a_s > 0, 0.0, -jnp.inf).astype(F32)
    if taus[0] == taus[1]:
        solve = vmappable_symmetric(opts, backend, taus[0])  # vmap: one packed loop (batched_loop)
        h, errors, n_iters = solve(X, a_s, prm, sg(threshold), h0, ok)
        f = g = h
    else:
        solve = loop_over_batch(lambda *v: parallel_solve(*v, opts, backend, taus))
        f, g, errors, n_iters = solve(X, a_s, prm, sg(threshold), h0, h0, ok)
    nan = jnp.float32(jnp.nan)
    f, g = jnp.where(ok, f, nan), jnp.where(ok, g, nan)
    errors = jnp.where(ok, errors, nan)
    n_iters = jnp.where(ok, n_iters, 0)
    converged = ok & ~jnp.any(jnp.isnan(errors)) & (errors[-1] < threshold)
    kcfg = KernelConfig(opts.precision, backend, implicit, taus, symmetric=taus[0] == taus[1])
    total = plan_mass(X, X, f, g, prm, kcfg, lambda: jnp.sum(
        kernel_ops.apply_plan(X, X, f, g, prm, precision=opts.precision, backend=backend)[1]))
    cost = reg_ot_cost(kcfg, x32, x32, a32, a32, eps, s, f, g, total, labels)
    f_out, g_out = potentials(kcfg, x32, x32, a32, a32, eps, s, f, g, labels)
    if taus[0] == taus[1]:  # h = (f + g) / 2 of any solution: its VJP has no gauge component
        f_out = g_out = 0.5 * (f_out + g_out)
    return cost, (f_out, g_out), errors, converged, n_iters


@functools.partial(jax.jit, static_argnames=("opts", "backend", "static_b", "symmetric", "implicit", "taus"))
def _divergence_jit(x, y, a, b, eps, scale, threshold, offset, opts, backend, static_b, symmetric,
                    implicit=ImplicitOptions(), taus=(1.0, 1.0), labels=None):
    x32, y32, a32, b32, eps, scale, threshold = as_f32(x, y, a, b, eps, scale, threshold)
    ok = inputs_ok(x32, y32, a32, b32, eps, scale, threshold, positive=(eps, scale, threshold), nonneg=(a32, b32),
                   balanced=((a32, b32),) if unbalanced.is_balanced(*taus) else ()) & values_ok(labels, True)
    lx, ly, w = (None, None, None) if labels is None else labels
    xy = solve_problem(x32, y32, a32, b32, eps, scale, threshold, None, opts, backend, implicit, taus, labels)
    xx = _self_term(x32, a32, eps, scale, threshold, ok, opts, backend, symmetric, implicit, taus, lx, w)
    if static_b:
        yy = (jnp.asarray(offset, F32), None, None, None, None)
    else:
        yy = _self_term(y32, b32, eps, scale, threshold, ok, opts, backend, symmetric, implicit, taus, ly, w)
    mass = unbalanced.divergence_mass_term(jnp.sum(a32), jnp.sum(b32), jax.lax.stop_gradient(eps))
    div = xy.reg_ot_cost - 0.5 * (xx[0] + yy[0]) + mass
    out = SinkhornDivergenceOutput(
        divergence=div, a=a32, b=b32,
        potentials=((xy.f, xy.g), xx[1], yy[1]),
        errors=(xy.errors, xx[2], yy[2]),
        converged=(xy.converged, xx[3], yy[3]),
        n_iters=(xy.n_iters, xx[4], yy[4]),
        costs=(xy.reg_ot_cost, xx[0], yy[0]),
    )
    return div, out


def sinkhorn_divergence(
    x: jax.Array,
    y: jax.Array,
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    *,
    epsilon: Any,
    scale_cost: Any = 1.0,
    threshold: Any = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    static_b: bool = False,
    offset_static_b: Any = None,
    symmetric_sinkhorn: bool = True,
    backend: str | None = None,
    implicit: ImplicitOptions | None = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    label_x: jax.Array | None = None,
    label_y: jax.Array | None = None,
    label_cost: jax.Array | None = None,
) -> tuple[jax.Array, SinkhornDivergenceOutput]:
    """Sinkhorn divergence between point clouds, OTT-JAX conventions (module docstring).

    Equivalent to ``ott.tools.sinkhorn_divergence.sinkhorn_divergence(PointCloud, x, y,
    a=a, b=b, epsilon=epsilon, scale_cost=scale_cost, static_b=static_b,
    offset_static_b=offset_static_b, symmetric_sinkhorn=symmetric_sinkhorn,
    solve_kwargs=dict(threshold=..., inner_iterations=..., min_iterations=...,
    max_iterations=...))``. ``epsilon`` is required and absolute (OTT's default of
    5% of the mean cost is not reproduced). Differentiable in x, y, a, b, epsilon,
    scale_cost; works under ``jax.jit`` (epsilon etc. traced).
    ``tau_a``, ``tau_b``: OTT's KL-relaxed marginals (``solve_kwargs=dict(tau_a=..., tau_b=...)``;
    module docstring, "Unbalanced"), static Python floats in (0, 1]; a traced value raises.
    ``label_x``, ``label_y``, ``label_cost`` W (K, K), symmetric: the label-augmented cost
    ``s (|x_i - y_j|^2 + W[label_x_i, label_y_j])`` in the (x, y) term, W[label_x_i, label_x_j] in the
    (x, x) term, W[label_y_i, label_y_j] in the (y, y) term (:func:`.sinkhorn`'s rules); first
    derivatives only. x (B, n, d), y (B, m, d), a (B, n), b (B, m) (labels (B, n), (B, m) with one
    ``label_cost``): B problems as ``jax.vmap`` of this call (:mod:`.leading_batch`), the outputs
    with a leading (B,) axis.
    """
    taus = check_taus(tau_a, tau_b)
    if is_batch(x, y):
        kw = dict(epsilon=epsilon, scale_cost=scale_cost, threshold=threshold, inner_iterations=inner_iterations,
                  min_iterations=min_iterations, max_iterations=max_iterations, precision=precision,
                  static_b=static_b, offset_static_b=offset_static_b, symmetric_sinkhorn=symmetric_sinkhorn,
                  backend=backend, implicit=implicit, tau_a=tau_a, tau_b=tau_b)
        return over_batch(lambda x, y, a, b, lx, ly: sinkhorn_divergence(x, y, a, b, label_x=lx, label_y=ly,
                                                                       label_cost=label_cost, **kw),
                          x, y, a, b, what="sinkhorn_divergence",
                          rows={"label_x": (label_x, "x"), "label_y": (label_y, "y")})
    labels = checked(label_x, label_y, label_cost, jnp.shape(x)[0], jnp.shape(y)[0], square=True)
    x, y, a, b = check_problem(x, y, a, b, epsilon, scale_cost, taus)
    inner, lo, hi = check_iterations(threshold, inner_iterations, min_iterations, max_iterations)
    opts = LoopOptions(precision, inner, lo, hi)
    check_backend(backend)
    if offset_static_b is not None and not static_b:
        raise ValueError("offset_static_b is only used with static_b=True; pass static_b=True or drop it")
    offset = 0.0 if offset_static_b is None else offset_static_b
    return _divergence_jit(x, y, a, b, epsilon, scale_cost, threshold, offset, opts=opts, backend=backend,
                           static_b=bool(static_b), symmetric=bool(symmetric_sinkhorn),
                           implicit=implicit_options(implicit), taus=taus, labels=labels)
