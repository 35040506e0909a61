"""The coarse-to-fine extrapolation of the multiscale solve (torch; d <= 3).

At eps_jump the potentials move from the clusters to the points: every fine point's potential is
a softmin over the other side's clusters with their coarse potentials. :func:`dense_lift` takes
every cluster; with truncation and ``tol`` (the lift is then at blur^2, where the first fine sweep
runs too) and enough points per cluster, :func:`lift_truncated` takes only the first fine sweep's
kept cluster pairs, whose masks come from upper bounds of the lifted potentials at the centroids
(:func:`lifted_fits`, bounds.lifted_fit), before any lifted potential exists. ``LIFT`` chooses.
"""

from __future__ import annotations

import torch

from ot_triton_jax.core import multiscale_rules as rules

from ..kernel_ops import apply_plan, lift_gathered, lse_update
from . import bounds as mb
from .clusters import kept_lists_many
from .problem import Problem

# the coarse-to-fine lift over the first sweep's masks: "auto" where
# multiscale_rules.lift_truncated_worthwhile, "always" (tests), "never" (the dense lift; A/B benchmarks)
LIFT = "auto"


def truncated_lift(truncated: bool, check: bool, points: int, clusters: int, relaxed: bool = False) -> bool:
    """Whether the solve lifts over the first sweep's masks (``LIFT``): only with truncation and ``tol``
    (the lift is then at blur^2, the first fine sweep's eps), never with relaxed marginals (its
    bounds, bounds.lifted_fit, assume the undamped lift)."""
    if relaxed:
        return False
    if LIFT not in ("auto", "always", "never"):
        raise ValueError(f"torch_api.multiscale.lift.LIFT must be 'auto', 'always' or 'never', got {LIFT!r}")
    if not (truncated and check) or LIFT == "never":
        return False
    return LIFT == "always" or rules.lift_truncated_worthwhile(points, clusters)


def dense_lift(pb: Problem, coarse: tuple, prm) -> tuple:
    """The lift over every cluster: (f_ba, g_ab, f_aa, g_bb) at the points from the coarse ones
    (damped on a relaxed side, as every update)."""
    f_ba, g_ab, f_aa, g_bb = coarse
    rx, ry = rules.relax_indices(*pb.rho)

    def dense(src, tgt, pot, logw, relax_at):
        return lse_update(src, tgt, pot, prm, pb.precision, logw_in=logw, relax_at=relax_at)[0]
    return (dense(pb.X, pb.Yc, g_ab, pb.lbc, rx), dense(pb.Y, pb.Xc, f_ba, pb.lac, ry),
            dense(pb.X, pb.Xc, f_aa, pb.lac, rx) if pb.debias else None,
            dense(pb.Y, pb.Yc, g_bb, pb.lbc, ry) if pb.debias else None)


def lifted_fits(pb: Problem, coarse: tuple, prm, eps: float) -> list:
    """Upper-bound fits of the four lifted potentials from the coarse ones, before the lift
    (bounds.lifted_fit): each lift's value and softmin mean at the centroids, one
    cluster-level plan pass each (``eps``: prm's, as a number)."""
    src_of = {0: (pb.Xc, pb.cx, pb.gx), 1: (pb.Yc, pb.cy, pb.gy)}
    out = []
    for k, (s, t, tgt_pot, logw) in enumerate(((0, 1, coarse[1], pb.lbc), (1, 0, coarse[0], pb.lac),
                                                (0, 0, coarse[2], pb.lac), (1, 1, coarse[3], pb.lbc))):
        if tgt_pot is None:
            out.append(None)
            continue
        (src, cl, geo), tgt = src_of[s], src_of[t][0]
        own = coarse[k]  # the source side's coarse potential: a shift that keeps P 1 near 1
        pv, r = apply_plan(src, tgt, own, tgt_pot + eps * logw, prm, pb.precision, tgt.x)
        value = own.double() - eps * torch.log(r.double())
        to_mean = src.x.double() - pv.double() / r.double()[:, None]
        out.append(mb.lifted_fit(geo, geo.center - cl.centroid.double(), value, to_mean))
    return out


def lift_truncated(pb: Problem, coarse: tuple, keep: list, fits: list, prm) -> tuple:
    """The coarse-to-fine extrapolation over the kept pairs of ``keep`` (kernels/lift_gathered.py),
    each sum shifted by the fits' prediction (an upper bound of the untruncated lift)."""
    f_ba, g_ab, f_aa, g_bb = coarse
    X, Y, Xc, Yc, lac, lbc = pb.X, pb.Y, pb.Xc, pb.Yc, pb.lac, pb.lbc
    lists = kept_lists_many(keep)  # one host read for the four masks' pair counts
    pred = [None if f is None else mb.predict(g, f) for f, g in zip(fits, pb.geometries())]
    return (lift_gathered(X, pb.cx.start, *lists[0], Yc, g_ab, lbc, pred[0], prm),
            lift_gathered(Y, pb.cy.start, *lists[1], Xc, f_ba, lac, pred[1], prm),
            lift_gathered(X, pb.cx.start, *lists[2], Xc, f_aa, lac, pred[2], prm) if pb.debias else None,
            lift_gathered(Y, pb.cy.start, *lists[3], Yc, g_bb, lbc, pred[3], prm) if pb.debias else None)
