"""``SamplesLoss(..., backend="multiscale")``: GeomLoss's coarse-to-fine solve for d <= 3.

The solve is ``solve.anneal`` (clusters, truncation, block-sparse fine sweeps); the
gradient in x and y is GeomLoss's rule (the last extrapolation's derivative) on the kept blocks,
``gradient.direction``; like the dense backend, no gradient flows to the weights.

Second order: the double backward (``create_graph=True``) is the HVP of ``hvp.multiscale_hvp`` (the
Hessian of the converged loss at blur^2 on the kept blocks, streaming CG); third derivatives
raise. Not yet: batches (B, N, D), ``torch.compile`` tracing (the
block lists have data-dependent sizes: this is a plain ``autograd.Function``, a graph break
under ``torch.compile``). The JAX twin is ``ot_triton_jax.samples_loss(..., backend="multiscale")``.
The float32 result differs from the dense backend's by the truncation (``SamplesLoss.last_multiscale``
reports the dropped-mass bound: the loss is within eps * bound of the untruncated last
extrapolation), by the coarse phase, by the finishing sweeps at blur^2 that bring the marginal
error below ``tol`` (``last_multiscale.marginal_error``; GeomLoss has none: ``tol=None`` runs its
schedule alone), and on the GPU with large clusters by the Taylor pass (``multiscale.taylor``: each
plan weight within a relative tol / 4 of its exponential at worst, ``multiscale_rules.taylor_order``;
``last_multiscale.taylor_passes`` counts its updates).

``reach`` (both marginals, rho = reach^2; ``reach_x`` / ``reach_y`` raise): the damped solve
(``multiscale_rules``: relaxed marginals, its truncation bound on max(f, f / tau)); the outputs are
GeomLoss's (the potentials, or the loss's per-point terms (rho + eps/2)(1 - exp(-f / rho)),
``samples_loss_relaxed.outputs``) and the x, y gradient GeomLoss's rule with the damping and the
terms' slopes (:func:`relaxed_coefs`), as the dense relaxed backend; the HVP of the loss is the
dense backend's relaxed one on the kept blocks (``hvp.hessian_relaxation``); that of the
potentials raises.
"""

from __future__ import annotations

import torch

from ot_triton_jax.core import unbalanced
from ot_triton_jax.core.unbalanced import geomloss_weight_slope

from .. import samples_loss_relaxed
from ..implicit_ops import required
from .gradient import direction
from .hvp import hessian_relaxation, multiscale_hvp
from .solve import MultiscaleResult, anneal


class MultiscaleSolve(torch.autograd.Function):
    """(F, G) = (f_ba - f_aa, g_ab - g_bb) (or (f_ba, g_ab) without debias), float32."""

    @staticmethod
    def forward(ctx, x, y, a, b, blur, scaling, diameter, cluster_scale, truncate, debias, precision, tol, sink,
                relax=None):
        rho = (None, None) if relax is None else relax[:2]
        res = anneal(x, y, a, b, blur, scaling, diameter, cluster_scale=cluster_scale, truncate=truncate,
                     debias=debias, precision=precision, tol=tol, means=tuple(ctx.needs_input_grad[:2]), rho=rho)
        sink.append(res)
        f_ba, g_ab, f_aa, g_bb = res.new
        ctx.save_for_backward(x, y, a, b)
        ctx.res, ctx.debias, ctx.precision, ctx.relax = res, debias, precision, relax
        if relax is not None:
            return relaxed_outputs(res, debias, relax)
        if debias:
            return f_ba - f_aa, g_ab - g_bb
        return f_ba.clone(), g_ab.clone()

    @staticmethod
    def backward(ctx, uF, uG):
        # differentiable (create_graph=True): MultiscaleDirection's backward is the HVP
        x, y, a, b = ctx.saved_tensors
        gx = gy = None
        if ctx.needs_input_grad[0] and uF is not None:
            rows = MultiscaleDirection.apply(x, y, a, b, 0, ctx.res, ctx.debias, ctx.precision, ctx.relax)
            gx = (uF.float()[:, None] * rows).to(x.dtype)
        if ctx.needs_input_grad[1] and uG is not None:
            rows = MultiscaleDirection.apply(x, y, a, b, 1, ctx.res, ctx.debias, ctx.precision, ctx.relax)
            gy = (uG.float()[:, None] * rows).to(y.dtype)
        return gx, gy, None, None, None, None, None, None, None, None, None, None, None, None


class MultiscaleDirection(torch.autograd.Function):
    """dF_i/dx_i (side 0) or dG_j/dy_j (side 1), (N, D) / (M, D) float32 (``direction``). Its VJP
    is the HVP (:class:`MultiscaleHVP`)."""

    @staticmethod
    def forward(ctx, x, y, a, b, side, res, debias, precision, relax=None):
        ctx.save_for_backward(x, y, a if side == 0 else b)
        ctx.side, ctx.res, ctx.debias, ctx.precision, ctx.relax = side, res, debias, precision, relax
        return direction(res, side, debias, precision, None if relax is None else relaxed_coefs(res, side, relax))

    @staticmethod
    def backward(ctx, u):
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return (None,) * 9
        hessian_relaxation(ctx.relax, 1.0)  # raises for the relaxed modes without an HVP
        x, y, w = ctx.saved_tensors
        tx, ty = MultiscaleHVP.apply(x, y, w, u, ctx.side, ctx.res, ctx.debias, ctx.precision, ctx.relax)
        return (tx if ctx.needs_input_grad[0] else None, ty if ctx.needs_input_grad[1] else None) + (None,) * 7


class MultiscaleHVP(torch.autograd.Function):
    """The VJP of :class:`MultiscaleDirection` for u: dF_i/dx_i = (1/a_i) dS/dx_i, so u maps to
    H (u / a, 0) (side 0; zero rows where a_i = 0) or H (0, u / b), H the Hessian of
    ``hvp.multiscale_hvp``. Linear in u (its VJP there is (1/w) times the side's block of H applied
    to the cotangent, H symmetric); derivatives in x, y (third order) raise."""

    @staticmethod
    def forward(ctx, x, y, w, u, side, res, debias, precision, relax=None):
        ctx.save_for_backward(w)
        ctx.side, ctx.res, ctx.debias, ctx.precision, ctx.relax = side, res, debias, precision, relax
        ctx.tensor_pos = [0, 1, 2, 3]  # for implicit_ops.required
        vx, vy = _directions(w, u, side)
        tx, ty = multiscale_hvp(res, vx, vy, debias, precision, relax=relax)
        return tx.to(x.dtype), ty.to(y.dtype)

    @staticmethod
    def backward(ctx, gtx, gty):
        if any(required(ctx, i) for i in range(3)):
            raise NotImplementedError("third derivatives of SamplesLoss(backend='multiscale') are not implemented "
                                      "(its HVP is linear in the direction only): differentiate the HVP in the "
                                      "direction alone")
        if not required(ctx, 3):
            return (None,) * 9
        (w,) = ctx.saved_tensors
        tx, ty = multiscale_hvp(ctx.res, gtx, gty, ctx.debias, ctx.precision, relax=ctx.relax)
        t = tx if ctx.side == 0 else ty
        w = w.detach().float()
        gu = torch.where(w[:, None] > 0, t / torch.where(w > 0, w, 1.0)[:, None], 0.0)
        return None, None, None, gu, None, None, None, None, None


def _directions(w, u, side):
    """(vx, vy): (u / w, None) (side 0) or (None, u / w), zero rows where w = 0."""
    w = w.detach().float()
    v = torch.where(w[:, None] > 0, u.float() / torch.where(w > 0, w, 1.0)[:, None], 0.0)
    return (v, None) if side == 0 else (None, v)


def multiscale_potentials(x, y, a, b, blur: float, scaling: float, diameter: float, cluster_scale, truncate,
                          debias: bool, precision: str, tol: float | None,
                          relax: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, MultiscaleResult]:
    """(F, G, the solve's result) for one problem x (N, D), y (M, D), D <= 3. ``relax``: None
    (balanced) or (rho_x, rho_y, mode), :func:`relaxed_outputs`."""
    sink: list = []
    F, G = MultiscaleSolve.apply(x, y, a, b, blur, scaling, diameter, cluster_scale, truncate, debias,
                                 precision, tol, sink, relax)
    return F, G, sink[0]


# ----------------------------------------------------------------------------- relaxed marginals


def relaxed_outputs(res: MultiscaleResult, debias: bool, relax: tuple) -> tuple:
    """(F, G) of a relaxed solve, ``relax`` = (rho_x, rho_y, mode): mode "potentials" (the debiased
    potentials, as balanced), "terms" (GeomLoss's per-point loss terms, samples_loss_relaxed.outputs)
    or "envelope" (f_ba, g_ab themselves; sinkhorn's OTT convention, no debias)."""
    rho_x, rho_y, mode = relax
    if mode == "envelope":
        return res.new[0].clone(), res.new[1].clone()
    F, G = samples_loss_relaxed.outputs(res.new, debias, rho_x, rho_y, res.eps[-1], mode == "terms")
    return F, G


def relaxed_coefs(res: MultiscaleResult, side: int, relax: tuple) -> tuple:
    """gradient.direction's (c_cross, c_own) of one side: the damping rho / (rho + eps) times the
    loss term's slope at the last potentials (1 for "potentials"), as the dense relaxed backward
    (samples_loss_relaxed.relaxed_row); for "envelope" the last plan's row sums per unit weight,
    exp(-f / rho) (OTT's envelope gradient r_i x_i - sum_j P_ij y_j divided by the weight)."""
    rho_, eps = relax[side], res.eps[-1]
    cross, own = res.new[side], res.new[side + 2]
    if relax[2] == "envelope":
        return (torch.ones_like(cross) if rho_ is None else torch.exp(-cross / rho_)), None
    damp = unbalanced.damping(eps, rho_)
    def slope(p):
        return geomloss_weight_slope(torch, p, rho_, eps) if relax[2] == "terms" else torch.ones_like(p)
    return damp * slope(cross), (None if own is None else damp * slope(own))
