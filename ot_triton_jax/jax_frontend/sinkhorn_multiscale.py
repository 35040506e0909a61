"""``sinkhorn(..., multiscale=MultiscaleOptions())`` in JAX (d <= 3): the twin of torch_api's.

OTT's problem solved by the multiscale backend, as ``torch_api.multiscale.sinkhorn`` states it
(the mapping is ``ot_triton_jax.core.multiscale_rules``'s): the points scaled by
sqrt(2 / scale_cost), blur = sqrt(epsilon), no debiasing, finishing to marginal error
``threshold``, through this frontend's multiscale SamplesLoss twin (``samples_loss_multiscale``:
the same solve on the same device memory). Eager only (raises under ``jax.jit`` / ``jax.vmap``).

Outputs: OTT's potentials f = F + eps log a, g = G + eps log b, and reg_ot_cost = <a, F> + <b, G>
+ eps (sum a sum b - sum a) (OTT's dual objective with sum P = sum a). ``jax.grad`` of
reg_ot_cost in x, y, a, b (a, b: [a > 0] (F - eps) + eps sum b, the dense solver's envelope
gradient, defined up to a constant as the potentials are); HVP in x, y by
``jax.jvp(jax.grad(f))``. Differentiating f or g raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ..core import multiscale_rules as rules, unbalanced
from ..core.checks import positive
from .interop import concrete_value, is_tracer, to_torch
from .kernel_ops import F32, masked_log
from .samples_loss_multiscale import TRACED, last_multiscale_report, multiscale_samples_loss

__all__ = ["MultiscaleSinkhornOutput", "sinkhorn_multiscale"]


@dataclass(frozen=True)
class MultiscaleSinkhornOutput(rules.MultiscaleOutputMethods):
    """As torch_api's :class:`MultiscaleSinkhornOutput`: f, g (OTT's potentials; their derivative
    raises), reg_ot_cost (differentiable), converged, marginal_error, dropped_mass_bound, epsilon,
    scale_cost, threshold, report (the solve's ``last_multiscale_report()``)."""

    f: jax.Array
    g: jax.Array
    reg_ot_cost: jax.Array
    converged: bool
    marginal_error: float | None
    dropped_mass_bound: float
    epsilon: float
    scale_cost: float
    threshold: float
    report: dict


@jax.custom_vjp
def _no_derivative(value, x, y, a, b):
    return value


def _no_derivative_fwd(value, x, y, a, b):
    return value.value, None


def _no_derivative_bwd(_, ct):
    if isinstance(ct, SymbolicZero):
        return None, None, None, None, None
    raise NotImplementedError(rules.POTENTIAL_DERIVATIVES)


_no_derivative.defvjp(_no_derivative_fwd, _no_derivative_bwd, symbolic_zeros=True)


def number(name: str, v) -> float:
    """``epsilon`` / ``scale_cost`` / ``threshold`` as a positive float; a traced one (jit, vmap, or a
    derivative through it) raises."""
    if is_tracer(v):
        raise NotImplementedError(f"{name}: with multiscale=... it must be a concrete number (derivatives "
                                  f"through {name} and jax.jit / jax.vmap are not supported there; the dense "
                                  "solver has them: drop multiscale=)")
    return positive(name, np.asarray(v).reshape(()))  # numpy: jnp would make a tracer inside jit


def sinkhorn_multiscale(x, y, a, b, *, epsilon, scale_cost, threshold, precision: str,
                        options: rules.MultiscaleOptions, taus: tuple = (1.0, 1.0)) -> MultiscaleSinkhornOutput:
    """The solve for checked shapes (x (n, d), y (m, d), d <= 3, weights (n,), (m,)); ``taus``
    (tau_a, tau_b) checked: relaxed as torch_api.multiscale.sinkhorn (:func:`_relaxed`)."""
    if not isinstance(options, rules.MultiscaleOptions):
        raise TypeError(f"multiscale must be a MultiscaleOptions (or None), got {type(options).__name__}")
    rules.check_dim(x.shape[1])
    eps, scale, tol = (number(k, v) for k, v in (("epsilon", epsilon), ("scale_cost", scale_cost),
                                                    ("threshold", threshold)))
    values = [concrete_value(v) for v in (x, y, a, b)]
    if any(v is None for v in values):
        raise NotImplementedError(TRACED)
    from torch_api import checks as torch_checks  # the value rules, once, on zero-copy views
    tx, ty, ta, tb = (to_torch(jnp.asarray(v)) for v in values)
    relaxed = not unbalanced.is_balanced(*taus)
    torch_checks.values({"x": tx, "y": ty}, {"a": ta, "b": tb}, balanced_pair=None if relaxed else ("a", "b"))
    blur, k = rules.ott_to_geomloss(eps, scale)
    cs = None if options.cluster_scale is None else options.cluster_scale * k
    out = jnp.promote_types(jnp.promote_types(x.dtype, a.dtype), F32)
    if relaxed:
        return _relaxed(x * k, y * k, x, y, a, b, blur, cs, options, precision, eps, scale, tol, taus, out)
    F, G = multiscale_samples_loss(x * k, y * k, a, b, blur=blur, scaling=options.scaling, diameter=None,
                                   cluster_scale=cs, truncate=options.truncate, tol=tol, debias=False,
                                   potentials=True, precision=precision, out_dtype=out)
    report = last_multiscale_report()
    a_, b_ = a.astype(out), b.astype(out)
    # the value <a, F> + <b, G> + eps (sum a sum b - sum a); the stopped eps sum b only fixes the value,
    # so that the gradients in a, b are the dense solver's ([a > 0] (F - eps) + eps sum b, likewise b)
    cost = (jnp.sum(a_ * jnp.where(a_ > 0, F - eps, 0.0)) + jnp.sum(b_ * jnp.where(b_ > 0, G - eps, 0.0))
            + eps * jnp.sum(a_) * jnp.sum(b_) + eps * jax.lax.stop_gradient(jnp.sum(b_)))
    f = jax.lax.stop_gradient(F) + eps * masked_log(jax.lax.stop_gradient(a_))
    g = jax.lax.stop_gradient(G) + eps * masked_log(jax.lax.stop_gradient(b_))
    f, g = _no_derivative(f, x, y, a, b), _no_derivative(g, x, y, a, b)
    return MultiscaleSinkhornOutput(f=f, g=g, reg_ot_cost=cost, converged=bool(report["converged"]),
                                    marginal_error=report["marginal_error"],
                                    dropped_mass_bound=report["dropped_mass_bound"], epsilon=eps, scale_cost=scale,
                                    threshold=tol, report=report)


def _relaxed(xs, ys, x, y, a, b, blur, cs, options, precision, eps, scale, tol, taus, out):
    """OTT's relaxed problem, as torch_api.multiscale.sinkhorn's: the damped solve on a^tau_a,
    b^tau_b, f = F + tau_a eps log a, OTT's reg_ot_cost with the last plan's exact mass; its x, y
    gradient OTT's envelope (the "envelope" outputs' custom VJP), its a, b gradient the partials at
    fixed (f, g) (unbalanced.ott_cost_partials)."""
    tau_a, tau_b = taus
    rho_a, rho_b = (None if t == 1.0 else unbalanced.rho(eps, t) for t in taus)
    stop = jax.lax.stop_gradient
    wa, wb = (rules.ott_relaxed_weights(jnp, stop(w).astype(F32), t) for w, t in ((a, tau_a), (b, tau_b)))
    F, G = multiscale_samples_loss(xs, ys, wa, wb, blur=blur, scaling=options.scaling, diameter=None,
                                   cluster_scale=cs, truncate=options.truncate, tol=tol, debias=False,
                                   potentials=True, precision=precision, out_dtype=out,
                                   relax=(rho_a, rho_b, "envelope"))
    report = last_multiscale_report()
    a_, b_ = a.astype(out), b.astype(out)
    a0, b0 = stop(a_), stop(b_)
    f, g, total = unbalanced.ott_from_damped(jnp, stop(F), stop(G), a0, b0, eps, tau_a, tau_b)
    value = sum(unbalanced.ott_reg_cost_terms(jnp, f, g, a0, b0, eps, tau_a, tau_b, total))
    ga, gb, _ = unbalanced.ott_cost_partials(jnp, f, g, a0, b0, eps, tau_a, tau_b)
    envelope = jnp.sum(wa.astype(out) * F) + jnp.sum(wb.astype(out) * G)  # its x, y gradient only
    mass = jnp.sum(ga * a_) + jnp.sum(gb * b_)  # its a, b gradient only
    cost = value + (envelope - stop(envelope)) + (mass - stop(mass))
    f, g = _no_derivative(f, x, y, a, b), _no_derivative(g, x, y, a, b)
    return MultiscaleSinkhornOutput(f=f, g=g, reg_ot_cost=cost, converged=bool(report["converged"]),
                                    marginal_error=report["marginal_error"],
                                    dropped_mass_bound=report["dropped_mass_bound"], epsilon=eps, scale_cost=scale,
                                    threshold=tol, report=report)
