"""``sinkhorn(..., multiscale=MultiscaleOptions())``: the OTT-convention problem solved by the
multiscale backend (d <= 3; clusters, truncation, block-sparse sweeps).

OTT's problem (C = |x - y|^2 / scale_cost, epsilon absolute) is the multiscale solve's GeomLoss
problem on the points scaled by k = sqrt(2 / scale_cost) at blur = sqrt(epsilon), without
debiasing, finishing to a marginal error ``threshold`` (``ot_triton_jax.core.multiscale_rules``
states the mapping). The solve differs from the dense one: it anneals eps from the clouds'
diameter^2 down to ``epsilon`` (GeomLoss's schedule, ``scaling``) instead of iterating at
``epsilon`` from zero potentials, and streams only the blocks the truncation bound keeps.

Outputs (:class:`MultiscaleSinkhornOutput`): OTT's potentials f = F + eps log a, g = G + eps log b
(-inf where a weight is 0), and ``reg_ot_cost`` = <a, F> + <b, G> + eps (sum a sum b - sum a),
OTT's dual objective with sum P taken as sum a. Derivatives: ``reg_ot_cost`` in x, y (GeomLoss's
rule on the kept blocks) and a, b (the envelope theorem with f, g held fixed, as the dense
solver's Danskin mode: [a > 0] (F - eps) + eps sum b, likewise for b; like f, g, defined up to a
constant, so that they agree with the dense solver's along mass-preserving directions),
HVP in x, y by double backward (the multiscale HVP, CG on the kept blocks); differentiating f, g
themselves, or through epsilon / scale_cost, raises (the dense solver has those). Not traced by
``torch.compile`` (data-dependent block lists: a graph break).

Relaxed marginals (``tau_a`` / ``tau_b`` < 1, OTT's): OTT's update f = tau_a (eps log a - eps LSE)
is the damped GeomLoss update of F = f - tau_a eps log a on the weights a^tau_a, b^tau_b
(``multiscale_rules.ott_relaxed_weights``), so the solve is the damped one (rho = eps tau / (1 - tau)
held along the schedule, ``multiscale_rules``: relaxed marginals, with its truncation bound); f, g
as above with tau eps log a; ``reg_ot_cost`` OTT's relaxed objective (``unbalanced.ott_reg_cost_terms``)
with sum P the last plan's exact mass sum a exp(-f / rho_a); ``marginal_error`` the relaxed target's
||P 1 - a exp(-f / rho)||_1. First derivatives: in x, y OTT's envelope 2s (r_i x_i - sum_j P_ij y_j),
r = P 1 (on the kept blocks), in a, b the partials of the objective at fixed (f, g), as the dense
relaxed solver; the HVP raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_triton_jax.core import multiscale_rules as rules, unbalanced

from .. import checks as check
from ..samples_loss_ops import diameter as bounding_diameter
from ..sinkhorn_loops import masked_log
from .samples_loss import multiscale_potentials
from .solve import MultiscaleResult

__all__ = ["MultiscaleSinkhornOutput", "sinkhorn_multiscale"]


class _NoDerivative(torch.autograd.Function):
    """The potentials f, g: values whose derivative in x, y, a, b is not implemented (it raises,
    never a silent zero)."""

    @staticmethod
    def forward(ctx, value, *inputs):
        return value.clone()

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(rules.POTENTIAL_DERIVATIVES)


@dataclass
class MultiscaleSinkhornOutput(rules.MultiscaleOutputMethods):
    """f, g: OTT's potentials (float32, detached from autograd: their derivative raises);
    reg_ot_cost: OTT's dual objective (differentiable in x, y, a, b, twice in x, y);
    converged: 0-d bool tensor (the marginal error met ``threshold``); marginal_error: the largest
    ||P 1 - a||_1 of the truncated plans entering the last extrapolation; dropped_mass_bound: the
    reported bound on their plan mass in the skipped blocks (reg_ot_cost is within epsilon times
    it of the untruncated last extrapolation); report: the solve's MultiscaleResult (clusters,
    kept fraction, sweeps)."""

    f: torch.Tensor
    g: torch.Tensor
    reg_ot_cost: torch.Tensor
    converged: torch.Tensor
    marginal_error: float | None
    dropped_mass_bound: float
    epsilon: float
    scale_cost: float
    threshold: float
    report: MultiscaleResult


def _number(name: str, v) -> float:
    if isinstance(v, torch.Tensor):
        if v.requires_grad:
            raise NotImplementedError(f"{name}: derivatives through {name} are not implemented with "
                                      "multiscale=...; pass a number or a tensor without grad, or drop multiscale=")
        v = float(v.detach().reshape(()))
    return check.positive(name, v)


def sinkhorn_multiscale(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, epsilon, scale_cost,
                        threshold, precision: str, options: rules.MultiscaleOptions, tau_a: float = 1.0,
                        tau_b: float = 1.0) -> MultiscaleSinkhornOutput:
    """The solve for checked shapes (x (n, d), y (m, d), d <= 3, weights (n,), (m,)); ``tau_a``,
    ``tau_b`` checked, in (0, 1] (module docstring)."""
    if not isinstance(options, rules.MultiscaleOptions):
        raise TypeError(f"multiscale must be a MultiscaleOptions (or None), got {type(options).__name__}")
    rules.check_dim(x.shape[1])
    eps, scale, tol = _number("epsilon", epsilon), _number("scale_cost", scale_cost), _number("threshold", threshold)
    check.finite("x", x)
    check.finite("y", y)
    relaxed = not unbalanced.is_balanced(tau_a, tau_b)
    check.values({"x": x, "y": y}, {"a": a, "b": b}, balanced_pair=None if relaxed else ("a", "b"))
    blur, k = rules.ott_to_geomloss(eps, scale)
    xs, ys = x * k, y * k  # differentiable: the gradient in x is k times the one in xs
    diam = bounding_diameter(xs, ys) or blur
    cs = None if options.cluster_scale is None else options.cluster_scale * k
    if relaxed:
        return _relaxed(xs, ys, x, a, b, blur, diam, cs, options, precision, eps, scale, tol, tau_a, tau_b)
    F, G, res = multiscale_potentials(xs, ys, a, b, blur, options.scaling, diam, cs, options.truncate, False,
                                      precision, tol)
    out = torch.promote_types(torch.promote_types(x.dtype, a.dtype), torch.float32)
    a_, b_ = a.to(out), b.to(out)
    F, G = F.to(out), G.to(out)
    # value <a, F> + <b, G> + eps (sum a sum b - sum a); gradients in a, b those of the dense solver
    # (OTT's envelope: [a > 0] (F - eps) + eps sum b, likewise b): the detached eps sum b fixes the value
    cost = ((a_ * torch.where(a_ > 0, F - eps, 0.0)).sum() + (b_ * torch.where(b_ > 0, G - eps, 0.0)).sum()
            + eps * a_.sum() * b_.sum() + eps * b_.sum().detach())
    f = F.detach() + eps * masked_log(a.detach().to(out))
    g = G.detach() + eps * masked_log(b.detach().to(out))
    return _output(f, g, cost, res, (x, y, a, b), eps, scale, tol)


def _output(f, g, cost, res, leaves, eps, scale, tol) -> MultiscaleSinkhornOutput:
    """The output; f, g raise when differentiated through ``leaves`` (_NoDerivative)."""
    inputs = [t for t in leaves if t.requires_grad]
    if inputs:
        f, g = _NoDerivative.apply(f, *inputs), _NoDerivative.apply(g, *inputs)
    return MultiscaleSinkhornOutput(f=f, g=g, reg_ot_cost=cost,
                                    converged=torch.tensor(bool(res.converged), device=leaves[0].device),
                                    marginal_error=res.marginal_error, dropped_mass_bound=res.dropped_mass_bound,
                                    epsilon=eps, scale_cost=scale, threshold=tol, report=res)


def _relaxed(xs, ys, x, a, b, blur, diam, cs, options, precision, eps, scale, tol, tau_a, tau_b):
    """OTT's relaxed problem (module docstring): the damped GeomLoss solve on a^tau_a, b^tau_b
    (multiscale_rules.ott_relaxed_weights), f = F + tau_a eps log a, g likewise, reg_ot_cost OTT's
    (unbalanced.ott_reg_cost_terms) with sum P the last plan's exact mass (unbalanced.ott_from_damped);
    derivatives: in x, y OTT's envelope r_i x_i - sum_j P_ij y_j (gradient.direction on the kept blocks,
    r = a^tau exp(-F / rho_a) the last plan's row sums), in a, b the partials at fixed (f, g)
    (unbalanced.ott_cost_partials), as the dense solver's."""
    out = torch.promote_types(torch.promote_types(x.dtype, a.dtype), torch.float32)
    rho_a, rho_b = (None if t == 1.0 else unbalanced.rho(eps, t) for t in (tau_a, tau_b))
    wa, wb = (rules.ott_relaxed_weights(torch, w.detach().float(), t) for w, t in ((a, tau_a), (b, tau_b)))
    F, G, res = multiscale_potentials(xs, ys, wa, wb, blur, options.scaling, diam, cs, options.truncate, False,
                                      precision, tol, (rho_a, rho_b, "envelope"))
    a_, b_ = a.to(out), b.to(out)
    f, g, total = unbalanced.ott_from_damped(torch, F.detach().to(out), G.detach().to(out), a_.detach(), b_.detach(),
                                             eps, tau_a, tau_b)
    value = sum(unbalanced.ott_reg_cost_terms(torch, f, g, a_.detach(), b_.detach(), eps, tau_a, tau_b, total))
    ga, gb, _ = unbalanced.ott_cost_partials(torch, f, g, a_.detach(), b_.detach(), eps, tau_a, tau_b)
    envelope = (wa.to(out) * F.to(out)).sum() + (wb.to(out) * G.to(out)).sum()  # its x, y gradient only
    mass = (ga * a_).sum() + (gb * b_).sum()  # its a, b gradient only
    cost = value + (envelope - envelope.detach()) + (mass - mass.detach())
    return _output(f, g, cost, res, (xs, ys, a, b), eps, scale, tol)
