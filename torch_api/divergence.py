"""``torch_api.sinkhorn_divergence``: OTT-JAX's Sinkhorn divergence between point clouds.

The twin of ``ot_triton_jax.sinkhorn_divergence`` (same signature, defaults, loops
and kernels), which follows ``ott.tools.sinkhorn_divergence.sinkhorn_divergence`` on
``PointCloud`` geometries (OTT 0.6.0)::

    div = R(x, y) - 1/2 R(x, x) - 1/2 R(y, y) + 1/2 eps (sum a - sum b)^2

with R = ``reg_ot_cost`` of :func:`torch_api.sinkhorn` (C = |x - y|^2 / scale_cost,
absolute epsilon shared by the three terms; every convention of
torch_api/sinkhorn_solver.py holds). The (x, y) term is the alternating solver; with
``symmetric_sinkhorn=True`` (OTT's default) the (x, x) and (y, y) terms run OTT's
symmetric solve (``parallel_dual_updates=True`` with momentum 0.5: h <- (h + T(h)) / 2,
Feydy et al. 2019 eq. 25), whose marginal error is ||P 1 - a||_1 + ||P^T 1 - a||_1 and
whose R takes sum P from a pass over the plan (the "fixed4" pass with "float32", the
plan's row sums with "tf32"); with ``symmetric_sinkhorn=False`` they are plain
:func:`torch_api.sinkhorn` solves. ``static_b=True`` skips R(y, y) and uses
``offset_static_b`` (default 0) in its place. The same ``threshold`` /
``inner_iterations`` / ``min_iterations`` / ``max_iterations`` drive all solves (OTT's
``solve_kwargs``). The mass term's epsilon carries no derivative (as in the JAX twin;
the term is 0 for balanced problems, whose masses are equal).

Unbalanced: ``tau_a``, ``tau_b`` < 1 relax the marginals as in :func:`torch_api.sinkhorn`
(OTT's ``solve_kwargs`` tau_a, tau_b; rules in :mod:`ot_triton_jax.core.unbalanced`), for
all three problems: the (x, x) problem is (x, x, a, a) with (tau_a, tau_b), likewise (y, y).
With tau_a == tau_b the symmetric solve keeps f = g = h with the damped update
h <- 0.5 h + 0.5 tau (eps log a - eps LSE_j(...)), error 2 ||P 1 - a e^{-h/rho}||_1; with
tau_a != tau_b it runs both potentials in parallel (f <- 0.5 f + 0.5 tau_a (..g..),
g <- 0.5 g + 0.5 tau_b (..f..), both from the old state), error the sum of both sides'
relaxed errors (OTT's parallel_dual_updates with momentum 0.5). The masses may then differ,
and the term 1/2 eps (sum a - sum b)^2 (eps without derivative) corrects the combination.
First derivatives as below (the mass term's in a, b included); second derivatives in x, y as
below, each term's with the relaxed implicit system (:func:`torch_api.sinkhorn`); those involving
a or b raise ``NotImplementedError`` when a tau < 1.

Label costs: ``label_x``, ``label_y``, ``label_cost`` W (K, K), symmetric: the (x, y) term's cost is
``s (|x_i - y_j|^2 + W[label_x_i, label_y_j])``, the (x, x) term's
``s (|x_i - x_j|^2 + W[label_x_i, label_x_j])``, the (y, y) term's
``s (|y_i - y_j|^2 + W[label_y_i, label_y_j])``
(flash-sinkhorn's debiasing; :mod:`torch_api.label_inputs`). First derivatives as below;
second derivatives raise ``NotImplementedError``.

Derivatives: in x, y, a, b and, when they are tensors that require grad, epsilon and
scale_cost, by the envelope theorem on each term (the ``reg_ot_cost`` custom op); twice
differentiable in x, y, a, b (double backward: each term's Hessian by streaming CG, the
self terms' with both clouds moving; CG options ``implicit``). The potentials of every term
have their problem's implicit VJP in x, y, a, b (the self terms' in their one cloud:
:mod:`torch_api.self_potentials`; OTT's symmetric h as (f + g) / 2); with a label cost, in
epsilon or scale_cost, or twice, those of the self terms raise ``NotImplementedError``.
torch.compile traces the call without graph breaks (every solve and cost is a custom
op of :mod:`torch_api.sinkhorn_ops`); a new epsilon passed as a tensor never
recompiles. Values are checked inside the solve ops (they raise eagerly), shapes at
the call. Returns ``(divergence, SinkhornDivergenceOutput)`` like OTT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_triton_jax.core.implicit_solve import ImplicitOptions, implicit_options, options_key

from ot_triton_jax.core import checks as rules, unbalanced

from . import label_inputs
from .batched_divergence import packed_divergence
from . import sinkhorn_ops as ops
from .no_derivative import NoDerivative
from .self_potentials import self_potentials
from .sinkhorn_output import SinkhornOutput
from .sinkhorn_solver import prepare, sinkhorn

__all__ = ["sinkhorn_divergence", "SinkhornDivergenceOutput"]


@dataclass(eq=False)
class SinkhornDivergenceOutput:
    """Details of :func:`sinkhorn_divergence`, fields as OTT's (and the JAX twin's).

    potentials, errors, converged, n_iters, costs: triples for the (x, y), (x, x) and
    (y, y) problems (the last entry is None with ``static_b``, except ``costs``, whose
    last entry is then ``offset_static_b``). ``costs`` are the three reg_ot_cost values;
    ``errors`` float32, ``converged`` 0-d bool and ``n_iters`` 0-d int32 tensors. On a
    batch every tensor has a leading batch axis (B).
    """

    divergence: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    potentials: tuple
    errors: tuple
    converged: tuple
    n_iters: tuple
    costs: tuple


_LABELLED = ("derivatives of the potentials of the divergence's self terms with a label cost are not implemented; "
             "the divergence itself is differentiable")


def _self_term(x, a, eps, scale, thr, opts, symmetric: bool, implicit, tau_a: float, tau_b: float,
               lx=None, w=None) -> SinkhornOutput:
    """The (x, x, a, a) problem: OTT's symmetric solve, or the alternating one; with a label cost
    (``lx``, ``w`` square) its cost adds s W[lx_i, lx_j]."""
    if not symmetric:
        return sinkhorn(x, x, a, a, epsilon=eps, scale_cost=scale, threshold=thr,
                        inner_iterations=opts.inner_iterations, min_iterations=opts.min_iterations,
                        max_iterations=opts.max_iterations, precision=opts.precision, implicit=implicit,
                        tau_a=tau_a, tau_b=tau_b, label_x=lx, label_y=lx, label_cost=w)
    args = (x.detach(), a.detach(), eps.detach(), scale.detach(), thr.detach(), opts.inner_iterations,
            opts.min_iterations, opts.max_iterations, opts.precision)
    key = options_key(implicit_options(implicit))
    if tau_a == tau_b:
        h, errors, n_iters, converged = ops.symmetric_solve(*args, tau_a, lx, w)
        f = g = h
    else:
        f, g, errors, n_iters, converged = ops.self_pair_solve(*args, tau_a, tau_b, lx, w)
    if w is None:
        f, g = self_potentials(x, a, f, g, eps, scale, opts.precision, key, (tau_a, tau_b), tau_a == tau_b)
    elif x.requires_grad or a.requires_grad:
        f = NoDerivative.apply(_LABELLED, f, x, a)
        g = f if tau_a == tau_b else NoDerivative.apply(_LABELLED, g, x, a)
    return SinkhornOutput(f=f, g=g, errors=errors, converged=converged, n_iters=n_iters, epsilon=eps,
                          scale_cost=scale, threshold=thr, inner_iterations=opts.inner_iterations,
                          precision=opts.precision, _x=x, _y=x, _a=a, _b=a, _eps=eps, _scale=scale,
                          _mass_from_plan=True, _implicit=key,
                          tau_a=tau_a, tau_b=tau_b, _labels=None if w is None else (lx, lx, w))


def sinkhorn_divergence(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    epsilon: float | torch.Tensor,
    scale_cost: float | torch.Tensor = 1.0,
    threshold: float | torch.Tensor = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    static_b: bool = False,
    offset_static_b: float | torch.Tensor | None = None,
    symmetric_sinkhorn: bool = True,
    implicit: ImplicitOptions | None = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    label_x: torch.Tensor | None = None,
    label_y: torch.Tensor | None = None,
    label_cost: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SinkhornDivergenceOutput]:
    """Sinkhorn divergence between point clouds, OTT-JAX conventions (module docstring).

    Equivalent to ``ott.tools.sinkhorn_divergence.sinkhorn_divergence(PointCloud, x, y,
    a=a, b=b, epsilon=epsilon, scale_cost=scale_cost, static_b=static_b,
    offset_static_b=offset_static_b, symmetric_sinkhorn=symmetric_sinkhorn,
    solve_kwargs=dict(threshold=..., inner_iterations=..., min_iterations=...,
    max_iterations=...))`` and to ``ot_triton_jax.sinkhorn_divergence``. ``epsilon`` is
    required and absolute (OTT's default of 5% of the mean cost is not reproduced).
    Returns ``(divergence, SinkhornDivergenceOutput)``; the divergence is a 0-d float32
    tensor differentiable in x, y, a, b (and epsilon / scale_cost given as tensors
    that require grad). ``tau_a``, ``tau_b`` in (0, 1]: OTT's relaxation of the marginals
    (module docstring; 1: strict): with a tau < 1 the masses may differ, and second
    derivatives involving a or b raise ``NotImplementedError``. ``label_x``, ``label_y``, ``label_cost``
    (W square and symmetric): the label-augmented cost in all three terms (module docstring).

    Batches: x (B, n, d), y (B, m, d), a (B, n), b (B, m), label_x (B, n), label_y (B, m) (or None)
    give the (B,) divergences and one output whose fields have a leading batch axis (as the JAX
    twin's vmapped output), each problem's its single call's to float32 rounding. The batch runs
    packed (:mod:`torch_api.batched_divergence`: one launch per half-step for the (x, y) problems,
    one for the 2B self problems' symmetric solves) when its derivatives are in the points only
    (the potentials' VJP and a double backward give each problem's single-call derivatives),
    ``symmetric_sinkhorn`` with tau_a == tau_b and no label cost; otherwise problem by problem
    with every option and derivative of the single call.
    """
    tau_a, tau_b = unbalanced.check_tau("tau_a", tau_a), unbalanced.check_tau("tau_b", tau_b)
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and (x.dim() == 3 or y.dim() == 3):
        kw = dict(epsilon=epsilon, scale_cost=scale_cost, threshold=threshold, inner_iterations=inner_iterations,
                  min_iterations=min_iterations, max_iterations=max_iterations, precision=precision,
                  static_b=static_b, offset_static_b=offset_static_b, symmetric_sinkhorn=symmetric_sinkhorn,
                  implicit=implicit, tau_a=tau_a, tau_b=tau_b, label_cost=label_cost)
        return _batch(x, y, dict(a=a, b=b, label_x=label_x, label_y=label_y), kw)
    labels = label_inputs.checked(label_x, label_y, label_cost, x.shape[0], y.shape[0], square=True)
    lab = dict(label_x=label_x, label_y=label_y, label_cost=label_cost) if labels is not None else {}
    lx, ly, w = labels if labels is not None else (None, None, None)
    taus = dict(tau_a=tau_a, tau_b=tau_b)
    if offset_static_b is not None and not static_b:
        raise ValueError("offset_static_b is only used with static_b=True; pass static_b=True or drop it")
    a, b, eps, scale, thr, opts = prepare(x, y, a, b, epsilon, scale_cost, threshold, inner_iterations,
                                          min_iterations, max_iterations, precision)
    xy = sinkhorn(x, y, a, b, epsilon=eps, scale_cost=scale, threshold=thr,
                  inner_iterations=opts.inner_iterations, min_iterations=opts.min_iterations,
                  max_iterations=opts.max_iterations, precision=opts.precision, implicit=implicit, **taus, **lab)
    xx = _self_term(x, a, eps, scale, thr, opts, bool(symmetric_sinkhorn), implicit, **taus, lx=lx, w=w)
    cost_xy, cost_xx = xy.reg_ot_cost, xx.reg_ot_cost
    if static_b:
        offset = 0.0 if offset_static_b is None else offset_static_b
        cost_yy = torch.as_tensor(offset, device=x.device).to(torch.float32).reshape(())
        yy = None
    else:
        yy = _self_term(y, b, eps, scale, thr, opts, bool(symmetric_sinkhorn), implicit, **taus, lx=ly, w=w)
        cost_yy = yy.reg_ot_cost
    mass = unbalanced.divergence_mass_term(a.to(torch.float32).sum(), b.to(torch.float32).sum(),
                                           eps.detach().to(device=x.device, dtype=torch.float32))
    div = cost_xy - 0.5 * (cost_xx + cost_yy) + mass

    def triple(get):
        return get(xy), get(xx), (None if yy is None else get(yy))

    out = SinkhornDivergenceOutput(
        divergence=div, a=a, b=b,
        potentials=triple(lambda o: (o.f, o.g)),
        errors=triple(lambda o: o.errors),
        converged=triple(lambda o: o.converged),
        n_iters=triple(lambda o: o.n_iters),
        costs=(cost_xy, cost_xx, cost_yy),
    )
    return div, out



def _batch(x, y, per_problem: dict, kw: dict) -> tuple[torch.Tensor, SinkhornDivergenceOutput]:
    """:func:`sinkhorn_divergence` of a (B, n, d) batch (its docstring): packed, or problem by
    problem with the outputs stacked."""
    sides = {"a": "x", "b": "y", "label_x": "x", "label_y": "y"}
    rules.batch_shapes(x.shape, y.shape, {n: (None if v is None else tuple(v.shape), sides[n])
                                          for n, v in per_problem.items()})
    packed = packed_divergence(x, y, per_problem, kw)
    if packed is not None:
        return packed["divergence"], SinkhornDivergenceOutput(**packed)
    outs = [sinkhorn_divergence(x[k], y[k], **{n: None if v is None else v[k] for n, v in per_problem.items()},
                                **kw)[1] for k in range(x.shape[0])]

    def stacked(get):
        values = [get(o) for o in outs]
        if values[0] is None:
            return None
        if isinstance(values[0], tuple):
            return tuple(stacked(lambda o, i=i: get(o)[i]) for i in range(len(values[0])))
        return torch.stack(values)

    fields = ("divergence", "a", "b", "potentials", "errors", "converged", "n_iters", "costs")
    out = SinkhornDivergenceOutput(**{name: stacked(lambda o, name=name: getattr(o, name)) for name in fields})
    return out.divergence, out
