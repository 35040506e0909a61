"""The gradient of the multiscale SamplesLoss in the points (torch; d <= 3): GeomLoss's rule, the
derivative of the last extrapolation with the other potentials held fixed, on the blocks the
solve kept (:func:`direction`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernel_ops import apply_plan, apply_plan_blocksparse
from .solve import MultiscaleResult


def direction(res: MultiscaleResult, side: int, debias: bool = True, precision: str = "float32",
              coef: tuple | None = None) -> Tensor:
    """dF_i/dx_i (side 0) or dG_j/dy_j (side 1), in the points' original order: the derivative of
    the last extrapolation (F = f_ba - f_aa; the other potentials held fixed, as GeomLoss's
    detached second arguments), on the blocks it kept:
    Q x / Q 1 - P y / P 1 (debias) or x - P y / P 1, P and Q the last extrapolation's softmin
    weights over the kept columns. The loss gradient is a_i dF_i/dx_i (b_j dG_j/dy_j).
    ``coef`` (relaxed marginals): per-point factors (c_cross, c_own) in the original order, the
    rows then c_cross (x - P y / P 1) - c_own (x - Q x / Q 1) (c_own unused without debias): the
    damping and the loss terms' slopes (samples_loss), or the plan's row sums per unit weight."""
    new, plans, prm, perms, extra = res.state
    eps = prm[0]
    mean = dict(zip(("xy", "yx", "xx", "yy"), extra["means"]))

    def softmin_mean(name, f_new):
        """P t / P 1 over the plan's kept columns (from the last sweep when it kept it)."""
        if mean[name] is not None:
            return mean[name]
        pt, r = apply(name, f_new)
        return pt / r[:, None]

    def apply(name, f_new):
        src, tgt, g_old, logw, ranges = plans[name]
        rng = None if ranges is None else ranges()
        if rng is None:
            return apply_plan(src, tgt, f_new, g_old + eps * logw, prm, precision, tgt.x)
        return apply_plan_blocksparse(src, tgt, f_new, g_old + eps * logw, prm, rng, precision, tgt.x)

    cross, own = ("xy", "xx") if side == 0 else ("yx", "yy")
    mean_t = softmin_mean(cross, new[side])
    inv = torch.argsort(perms[side])
    if coef is not None:
        pts = plans[cross][0].x
        rows = coef[0][:, None] * (pts - mean_t)[inv]
        if debias:
            rows = rows - coef[1][:, None] * (pts - softmin_mean(own, new[side + 2]))[inv]
        return rows
    rows = plans[cross][0].x - mean_t
    if debias:
        rows = softmin_mean(own, new[side + 2]) - mean_t
    return rows[inv]
