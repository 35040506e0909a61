"""The HVP of ``SamplesLoss(backend="multiscale")`` (torch; d <= 3).

The Hessian in (x, y) of the converged loss at eps = blur^2, S = OT(a, b) - 1/2 OT(a, a)
- 1/2 OT(b, b) (debias) or OT(a, b), applied to (vx, vy): the dense backend's definition
(``samples_loss_ops.hvp``: core.implicit_derivatives.debiased_hessian_apply, streaming CG),
evaluated at the multiscale solve's last extrapolation (OTT's f = f_ba + eps log a, ...), with
every plan restricted to the blocks its last sweep kept. The restriction is one pair set per plan
for both directions (``clusters.block_pair_ranges``: whole (x-block, y-block)
rectangles covering the kept cluster pairs), so P^T is the transpose of P and the operator CG
inverts is symmetric. It drops at most the solve's reported ``dropped_mass_bound`` of plan mass
(the rectangles contain the kept cluster pairs); with ``truncate=None``, or when the solve ends
on the clusters (``tol=None`` with the jump at blur^2), nothing is dropped and this is the
dense HVP at those potentials. With ``reach`` (one rho on both marginals) it is the dense
backend's relaxed HVP: c times the Hessian of OTT's relaxed divergence
(``core.unbalanced.geomloss_hessian_sides``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ot_triton_jax.core import multiscale_plans, runtime, unbalanced
from ot_triton_jax.core.implicit_derivatives import debiased_hessian_apply
from ot_triton_jax.core.implicit_solve import ImplicitOptions

from ..implicit_ops import Passes, _info
from ..kernel_ops import Cloud, apply_plan_blocksparse
from .clusters import block_pair_ranges
from ..sinkhorn_loops import masked_log


class BlockSparsePasses(Passes):
    """The streaming passes of a plan restricted to block rectangles: ``rows`` the ranges of the
    row blocks of ``X`` over ``Y``, ``cols`` those of ``Y``'s over ``X`` (one pair set)."""

    def __init__(self, X: Cloud, Y: Cloud, f: Tensor, g: Tensor, prm: Tensor, precision: str,
                 rows: Tensor, cols: Tensor):
        super().__init__(X, Y, f, g, prm, precision)
        self.rows, self.cols = rows, cols

    def apply(self, v):
        return apply_plan_blocksparse(self.X, self.Y, self.f, self.g, self.prm, self.rows, self.precision, v)

    def apply_t(self, u):
        return apply_plan_blocksparse(self.Y, self.X, self.g, self.f, self.prm, self.cols, self.precision, u)

    def apply_t_sq(self, u):
        half = torch.stack([0.5 * self.prm[0], self.prm[1]])  # P_ij^2 is the plan at eps / 2
        return apply_plan_blocksparse(self.Y, self.X, self.g, self.f, half, self.cols, self.precision,
                                      u[:, None])[0][:, 0]

    def weighted(self, w, A, B):
        return _weighted(self.apply, w, A, B)

    def weighted_t(self, w, A, B):
        return _weighted(self.apply_t, w, A, B)

    def transposed(self) -> "BlockSparsePasses":
        return BlockSparsePasses(self.Y, self.X, self.g, self.f, self.prm, self.precision, self.cols, self.rows)


def _weighted(apply, w: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """sum_j P_ij <w_i, A_j> B_j = sum_k w_ik (P [A_k B])_i: one apply of the k * p products."""
    n, k = w.shape
    p = B.shape[1]
    pv, _ = apply((A[:, :, None] * B[:, None, :]).reshape(A.shape[0], k * p))
    return torch.einsum("ik,ikp->ip", w, pv.reshape(n, k, p))


def hessian_relaxation(relax: tuple | None, eps: float) -> tuple[tuple, tuple]:
    """(taus, scales) of ``relax`` = (rho_x, rho_y, mode) (``samples_loss.relaxed_outputs``): balanced
    ((1, 1), (1, 1)); GeomLoss's loss terms those of ``unbalanced.geomloss_hessian_sides``; the
    other modes raise NotImplementedError."""
    if relax is None:
        return (1.0, 1.0), (1.0, 1.0)
    if relax[2] == "envelope":
        raise NotImplementedError("second derivatives (HVP) of sinkhorn(..., multiscale=...) with tau_a or "
                                  "tau_b < 1 are not implemented; the dense solver (multiscale=None) has them")
    return unbalanced.geomloss_hessian_sides(relax[0], relax[1], eps, relax[2] == "terms")


def multiscale_hvp(res, vx: Tensor | None, vy: Tensor | None, debias: bool, precision: str,
                   opts: ImplicitOptions | None = None, relax: tuple | None = None) -> tuple[Tensor, Tensor]:
    """(H_xx vx + H_xy vy, H_yx vx + H_yy vy) (float32, the points' original order) of the solve
    ``res`` (``solve.MultiscaleResult``); ``vx`` / ``vy`` None for zero. ``relax``: the solve's
    relaxation; with ``reach`` H is c times OTT's relaxed Hessian (:func:`hessian_relaxation`).
    Warns (RuntimeWarning) when a CG solve stops unconverged."""
    opts = opts or ImplicitOptions()
    new, plans, prm, perms, extra = res.state
    eps = prm[0]
    taus, scales = hessian_relaxation(relax, float(eps))
    X, Y = plans["xy"][0], plans["yx"][0]
    a_s, b_s = extra["weights"]
    la, lb = masked_log(a_s), masked_log(b_s)
    f, g = new[0] + eps * la, new[1] + eps * lb
    hx = new[2] + eps * la if debias else None
    hy = new[3] + eps * lb if debias else None
    keep = extra["keep"]
    if keep is None:  # nothing truncated: the dense passes
        ops_xy = Passes(X, Y, f, g, prm, precision)
        ops_xx = Passes(X, X, hx, hx, prm, precision) if debias else None
        ops_yy = Passes(Y, Y, hy, hy, prm, precision) if debias else None
    else:
        lx, ly = extra["labels"]
        block_m = multiscale_plans.blocksparse_block_m(X.d, precision, runtime.on_gpu())
        ops_xy = BlockSparsePasses(X, Y, f, g, prm, precision, *block_pair_ranges(keep[0], lx, ly, block_m))
        ops_xx = ops_yy = None
        if debias:
            ops_xx = BlockSparsePasses(X, X, hx, hx, prm, precision, *block_pair_ranges(keep[1], lx, lx, block_m))
            ops_yy = BlockSparsePasses(Y, Y, hy, hy, prm, precision, *block_pair_ranges(keep[2], ly, ly, block_m))
    px, py = perms
    vxs = None if vx is None else vx.to(torch.float32)[px]
    vys = None if vy is None else vy.to(torch.float32)[py]
    (tx, ty), infos = debiased_hessian_apply(ops_xy, ops_xx, ops_yy, (f, g, hx, hy), a_s, b_s, vxs, vys, opts,
                                             taus, scales)
    for info in infos:
        _info(info, "HVP of SamplesLoss(backend='multiscale')", opts.warn)
    return tx[torch.argsort(px)], ty[torch.argsort(py)]
