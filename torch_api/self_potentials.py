"""Derivatives of the potentials of a self problem (x, x, a, a): the divergence's (x, x) and (y, y) terms.

A self problem's potentials solve the (x, y, a, b) problem's optimality conditions at y = x and
b = a, so their VJP in the single cloud is the (x, y) problem's implicit VJP with both sides'
parts added: for cotangents (u_f, u_g), dx = (dx + dy)(u_f, u_g) and da = (da + db)(u_f, u_g)
(:func:`torch_api.implicit_ops.sinkhorn_potentials_vjp`, with the problem's taus).

OTT's symmetric solve returns one potential h = f = g (tau_a == tau_b). A balanced (x, x) problem's
solutions are (h + c, h - c) for any constant c, and h = (f + g) / 2 for every one of them; the
VJP of h for a cotangent u is therefore the pair's VJP for (u / 2, u / 2), which has no component
along the gauge direction (1, -1) and so is the same whatever solution the pair VJP assumes.
With tau_a != tau_b, f and g differ and have their own cotangents. Derivatives of the potentials
in epsilon or scale_cost, second derivatives, and those with a label cost raise
``NotImplementedError``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ot_triton_jax.core.implicit_solve import check_no_eps_tangent

from .implicit_ops import required, sinkhorn_potentials_vjp, _tensor_positions
from .no_derivative import NoDerivative

__all__ = ["self_potentials", "self_potentials_vjp"]

_SECOND = ("second derivatives of the potentials of a self problem (the divergence's (x, x) and (y, y) terms) "
           "are not implemented")


def self_potentials_vjp(x: Tensor, a: Tensor, f: Tensor, g: Tensor, uf: Tensor | None, ug: Tensor | None,
                        state: tuple) -> tuple[Tensor, Tensor]:
    """(dx, da): the VJP of the self problem's potentials (f, g) at (x, a) for cotangents (uf, ug)
    (None: zero); ``state`` = (epsilon, scale, precision, implicit key, (tau_a, tau_b))."""
    eps, scale, precision, key, taus = state
    uf = torch.zeros_like(f) if uf is None else uf
    ug = torch.zeros_like(g) if ug is None else ug
    dx, dy, da, db, _ = sinkhorn_potentials_vjp(x, x, a, a, eps, scale, f, g, uf, ug, precision, key, *taus)
    return dx + dy, da + db


@torch.library.custom_op("ot_triton::self_potentials", mutates_args=())
def _self_potentials(x: Tensor, a: Tensor, eps: Tensor, scale: Tensor, f: Tensor, g: Tensor, precision: str,
                     implicit: str, tau_a: float, tau_b: float, symmetric: bool) -> tuple[Tensor, Tensor]:
    """(f, g) unchanged; the autograd formula is the self problem's VJP (module docstring)."""
    return f.clone(), g.clone()


@_self_potentials.register_fake
def _(x, a, eps, scale, f, g, precision, implicit, tau_a, tau_b, symmetric):
    return torch.empty_like(f), torch.empty_like(g)


def _setup(ctx, inputs, output):
    x, a, eps, scale, f, g = inputs[:6]
    ctx.rest, ctx.symmetric = (inputs[6], inputs[7], (inputs[8], inputs[9])), inputs[10]
    ctx.save_for_backward(x, a, eps, scale, f, g)
    _tensor_positions(ctx, inputs)
    ctx.set_materialize_grads(False)


def _backward(ctx, uf, ug):
    if ctx.symmetric:  # h = (f + g) / 2: the first output is h, the second unused
        uf = ug = None if uf is None else 0.5 * uf
    if uf is None and ug is None:
        return (None,) * 11
    check_no_eps_tangent("the gradient of a function of the potentials", required(ctx, 2) or required(ctx, 3))
    x, a, eps, scale, f, g = ctx.saved_tensors
    with torch.no_grad():
        dx, da = self_potentials_vjp(x, a, f, g, uf, ug, (eps.detach(), scale.detach()) + ctx.rest)
    if torch.is_grad_enabled():  # a double backward: the first one's values, whose derivative raises
        dx, da = (NoDerivative.apply(_SECOND, t, x, a) for t in (dx, da))
    nx, na = ctx.needs_input_grad[:2]
    return (dx.to(x.dtype) if nx else None, da.to(a.dtype) if na else None) + (None,) * 9


_self_potentials.register_autograd(_backward, setup_context=_setup)


def self_potentials(x: Tensor, a: Tensor, f: Tensor, g: Tensor, eps: Tensor, scale: Tensor, precision: str,
                    key: str, taus: tuple, symmetric: bool) -> tuple[Tensor, Tensor]:
    """(f, g) of the self problem (x, x, a, a) attached to x, a (and epsilon, scale_cost, whose
    derivatives raise) with the implicit VJP (module docstring); ``symmetric``: OTT's symmetric
    solve's h (f is g). Returned unchanged when no input needs a gradient."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (x, a, eps, scale)):
        return f, g
    fo, go = _self_potentials(x, a, eps, scale, f.detach(), g.detach(), precision, key, float(taus[0]),
                              float(taus[1]), bool(symmetric))
    return (fo, fo) if symmetric else (fo, go)
