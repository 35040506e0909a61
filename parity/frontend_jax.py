"""The quantities of :mod:`parity.quantities` computed with the JAX frontend ``ot_triton_jax``.

The JAX twin of :mod:`parity.frontend_torch`: ``jax.jit``-compiled functions, each called once
(compilation included in the run, no warm-up call); the solve's outputs ride along as ``aux``
of the gradient / HVP, so one solve serves the potentials, the cost, the gradients and hvp_x.
JAX runs in float32 here: the float64 OTT-JAX reference lives in a subprocess
(:mod:`parity.references`), so ``jax_enable_x64`` never reaches this process.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import torch_api  # noqa: F401  (configures the GPU / Triton interpreter switch before jax)
import jax
import jax.numpy as jnp

import ot_triton_jax as otj

from .cases import Case, Inputs
from .solve_settings import SolveRecord, divergence_terms, geomloss_options, solve_kwargs, stop_kwargs


def _np(v: Any) -> np.ndarray:
    return np.asarray(v, dtype=np.float64)


def _record(converged: Any, n_iters: Any, errors: Any) -> SolveRecord:
    errs = np.asarray(errors)
    measured = errs[errs >= 0]
    return SolveRecord(converged=bool(converged), n_iters=int(n_iters),
                       last_error=float(measured[-1]) if measured.size else float("nan"))


def compute(case: Case, inp: Inputs, groups: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict[str, SolveRecord]]:
    """Values of every quantity in ``groups`` and the solves' records (keyed by group)."""
    kw = solve_kwargs(case, inp, otj.ImplicitOptions)
    kw.update({k: jnp.asarray(v) for k, v in inp.labels().items()})
    x, y, a, b, vx, vy, wf, wg = (jnp.asarray(getattr(inp, k)) for k in ("x", "y", "a", "b", "vx", "vy", "wf", "wg"))
    vals: dict[str, np.ndarray] = {}
    recs: dict[str, SolveRecord] = {}
    sinkhorn = lambda x, y, a, b: otj.sinkhorn(x, y, a, b, **kw)

    def cost_aux(x, y, a, b):  # the solve's outputs ride along as aux: one solve serves all
        out = sinkhorn(x, y, a, b)
        return out.reg_ot_cost, (out.f, out.g, out.reg_ot_cost, out.errors, out.converged, out.n_iters)

    if {"solve", "grad", "hvp"} & set(groups):
        grad_aux = jax.grad(cost_aux, argnums=(0, 1, 2, 3), has_aux=True)
        if "hvp" in groups:  # the primal of the JVP of the gradient is the gradient
            grads, tangents, aux = jax.jit(
                lambda x, y, a, b: jax.jvp(lambda t: grad_aux(t, y, a, b), (x,), (vx,), has_aux=True))(x, y, a, b)
            vals["hvp_x"] = _np(tangents[0])
            hy, _ = jax.jit(lambda x, y, a, b: otj.hvp(x, y, vy, wrt="y", a=a, b=b, **kw))(x, y, a, b)
            vals["hvp_y"] = _np(hy)
        elif "grad" in groups:
            grads, aux = jax.jit(grad_aux)(x, y, a, b)
        else:
            grads, aux = None, jax.jit(cost_aux)(x, y, a, b)[1]
        if grads is not None:
            vals.update({f"grad_{k}": _np(t) for k, t in zip("xyab", grads)})
        f, g, reg_ot_cost, errors, converged, n_iters = aux
        recs["solve"] = _record(converged, n_iters, errors)
        vals.update(f=_np(f), g=_np(g), reg_ot_cost=_np(reg_ot_cost))
    if "hvp_default" in groups:  # the library's default CG options at a converged forward
        dkw = {**kw, "implicit": None}
        for side, v in (("x", vx), ("y", vy)):
            h, _ = jax.jit(lambda x, y, a, b, v=v, side=side: otj.hvp(x, y, v, wrt=side, a=a, b=b, **dkw))(x, y, a, b)
            vals[f"hvp_default_{side}"] = _np(h)
    if "pot_vjp" in groups:
        def phi(x, y, a, b):
            out = sinkhorn(x, y, a, b)
            return jnp.sum(wf * jnp.where(a > 0, out.f, 0.0)) + jnp.sum(wg * jnp.where(b > 0, out.g, 0.0))
        vals.update({f"pot_vjp_{k}": _np(t) for k, t in zip("xyab", jax.jit(jax.grad(phi, (0, 1, 2, 3)))(x, y, a, b))})
    if "hess" in groups:
        vals["hess_xx"] = _np(jax.jit(jax.hessian(lambda x: sinkhorn(x, y, a, b).reg_ot_cost))(x))
    if "div" in groups:
        def div_aux(x, y):
            div, out = otj.sinkhorn_divergence(x, y, a, b, **kw)
            return div, (div, out.converged, out.n_iters, out.errors, out.costs)

        gdiv = jax.grad(div_aux, argnums=(0, 1), has_aux=True)
        grads, tangents, (div, conv, iters, errs, costs) = jax.jit(
            lambda x, y: jax.jvp(lambda t: gdiv(x, t), (y,), (vy,), has_aux=True))(x, y)
        recs["div"] = SolveRecord.of_divergence(conv, iters, errs)
        hx, _ = jax.jit(lambda x, y: otj.hvp(x, y, vx, a=a, b=b, loss="sinkhorn_divergence", **kw))(x, y)
        vals.update(div=_np(div), div_grad_x=_np(grads[0]), div_grad_y=_np(grads[1]),
                    div_hvp_y=_np(tangents[1]), div_hvp_x=_np(hx), div_terms=divergence_terms(costs))
    if "samples_loss" in groups:
        opts = geomloss_options(case, inp)
        loss = lambda x: otj.samples_loss(x, y, a, b, precision=case.precision, **opts)
        value, gx = jax.jit(jax.value_and_grad(loss))(x)
        F, G = jax.jit(lambda x, y: otj.samples_loss(x, y, a, b, potentials=True, precision=case.precision,
                                                     **opts))(x, y)
        vals.update(sl_value=_np(value), sl_grad_x=_np(gx), sl_f=_np(F), sl_g=_np(G))
    if "stop" in groups:
        out = jax.jit(lambda x, y, a, b: otj.sinkhorn(x, y, a, b, **stop_kwargs(case, inp)))(x, y, a, b)
        recs["stop"] = _record(out.converged, out.n_iters, out.errors)
        vals.update(stop_f=_np(out.f), stop_g=_np(out.g))
    return vals, recs
