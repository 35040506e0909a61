"""``SamplesLoss(..., backend="multiscale")``: GeomLoss's coarse-to-fine solve for d <= 3.

The solve is ``multiscale_solve.anneal`` (clusters, truncation, block-sparse fine sweeps); the
gradient in x and y is GeomLoss's rule (the last extrapolation's derivative) on the kept blocks,
``multiscale_solve.direction``; like the dense backend, no gradient flows to the weights.

Not yet: batches (B, N, D), the HVP / double backward (raises), ``torch.compile`` tracing (the
block lists have data-dependent sizes: this is a plain ``autograd.Function``, a graph break
under ``torch.compile``), the JAX twin. The float32 result differs from the dense backend's by
the truncation (``SamplesLoss.last_multiscale`` reports the dropped-mass bound: the loss is within
eps * bound of the untruncated last extrapolation), by the coarse phase, and by the finishing
sweeps at blur^2 that bring the marginal error below ``tol`` (``last_multiscale.marginal_error``;
GeomLoss has none: ``tol=None`` runs its schedule alone).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .multiscale_solve import MultiscaleResult, anneal, direction


class MultiscaleSolve(torch.autograd.Function):
    """(F, G) = (f_ba - f_aa, g_ab - g_bb) (or (f_ba, g_ab) without debias), float32."""

    @staticmethod
    def forward(ctx, x, y, a, b, blur, scaling, diameter, cluster_scale, truncate, debias, precision, tol, sink):
        res = anneal(x, y, a, b, blur, scaling, diameter, cluster_scale=cluster_scale, truncate=truncate,
                     debias=debias, precision=precision, tol=tol)
        sink.append(res)
        f_ba, g_ab, f_aa, g_bb = res.new
        ctx.res, ctx.debias, ctx.precision = res, debias, precision
        ctx.dtypes = (x.dtype, y.dtype)
        if debias:
            return f_ba - f_aa, g_ab - g_bb
        return f_ba.clone(), g_ab.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, uF, uG):
        gx = gy = None
        if ctx.needs_input_grad[0] and uF is not None:
            gx = (uF.float()[:, None] * direction(ctx.res, 0, ctx.debias, ctx.precision)).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1] and uG is not None:
            gy = (uG.float()[:, None] * direction(ctx.res, 1, ctx.debias, ctx.precision)).to(ctx.dtypes[1])
        return gx, gy, None, None, None, None, None, None, None, None, None, None, None


def multiscale_potentials(x, y, a, b, blur: float, scaling: float, diameter: float, cluster_scale, truncate,
                          debias: bool, precision: str, tol: float | None) -> tuple[torch.Tensor, torch.Tensor, MultiscaleResult]:
    """(F, G, the solve's result) for one problem x (N, D), y (M, D), D <= 3."""
    sink: list = []
    F, G = MultiscaleSolve.apply(x, y, a, b, blur, scaling, diameter, cluster_scale, truncate, debias,
                                 precision, tol, sink)
    return F, G, sink[0]
