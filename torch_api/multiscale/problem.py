"""One multiscale problem as every phase of the solve reads it (torch; d <= 3).

:class:`Problem` holds the clouds sorted by cluster (as kernel inputs, points and centroids), the
clusters, the weights and their logs, the truncation bound's geometry and the masks it gives
(:mod:`.bounds`), and the Taylor pass's view of each side (:mod:`.taylor`). :class:`Ranges` holds
the four plans' column ranges, built from their masks at first use.

The four plans are (x-y, y-x, x-x, y-y), in that order everywhere, and the potentials likewise
(f_ba, g_ab, f_aa, g_bb); the self terms are None without ``debias``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ot_triton_jax.core import multiscale_rules as rules

from ..kernel_ops import Cloud
from . import bounds as mb, taylor
from .clusters import Clusters, kept_ranges, kept_ranges_many


@dataclass
class Problem:
    """The sorted clouds X, Y (points) and Xc, Yc (cluster centroids) as kernel inputs, their
    clusters cx, cy and bound geometries gx, gy (bounds.geometry), the sorted weights a_s, b_s
    and the log-weights of the points (la, lb) and of the clusters (lac, lbc); the solve's
    options; ``per_cluster`` the mean points per cluster of each side; ``block_m`` the row block
    of the block-sparse kernels; ``taylor_passes`` counts the plan updates the Taylor pass made;
    ``rho`` the relaxation of each side (None: strict): the fits are then of the bound potentials
    h = max(p, p / tau) (multiscale_rules.bound_potential)."""

    X: Cloud
    Y: Cloud
    Xc: Cloud
    Yc: Cloud
    cx: Clusters
    cy: Clusters
    gx: mb.Geometry
    gy: mb.Geometry
    a_s: Tensor
    b_s: Tensor
    la: Tensor
    lb: Tensor
    lac: Tensor
    lbc: Tensor
    precision: str
    debias: bool
    truncate: float | None
    tol: float | None
    means: tuple
    per_cluster: tuple
    block_m: int
    taylor_passes: int = 0
    rho: tuple = (None, None)  # (rho_x, rho_y): KL-relaxed marginals (multiscale_rules.relaxed_rows)
    sides: dict = field(default_factory=dict, repr=False)  # the Taylor pass's view of X and Y, built at first use

    def geometries(self) -> tuple:
        """The bound geometries of the four potentials' sides (x, y, x, y)."""
        return self.gx, self.gy, self.gx, self.gy

    def taylor_side(self, side: int) -> taylor.TaylorSide:
        if not self.sides:  # both sides at once: their radii in one host read
            self.sides.update({0: taylor.TaylorSide(self.X.x, self.cx.label, self.cx.start),
                               1: taylor.TaylorSide(self.Y.x, self.cy.label, self.cy.start)})
            taylor.settle_radii(self.sides[0], self.sides[1])
        return self.sides[side]

    @property
    def relaxed(self) -> bool:
        return self.rho != (None, None)

    def fits_of(self, pots, eps: float) -> list:
        """The potentials' (f_ba, g_ab, f_aa, g_bb) fits on their clusters (bounds.fit); of their
        bound potentials at ``eps`` on a relaxed side (multiscale_rules.bound_potential)."""
        rhos = (self.rho[0], self.rho[1], self.rho[0], self.rho[1])
        return [None if p is None else mb.fit(g, rules.bound_potential(torch, p, eps, r))
                for p, g, r in zip(pots, self.geometries(), rhos)]

    def keeps(self, fits, eps) -> list:
        """Cluster keep masks (xy, yx = xy's transpose, xx, yy) from the potentials' fits."""
        gx, gy, truncate = self.gx, self.gy, self.truncate
        keep = [*mb.keep_pairs(gx, fits[0], gy, fits[1], eps, truncate, transposed=True), None, None]
        if self.debias:
            keep[2] = mb.keep_pairs(gx, fits[2], gx, fits[2], eps, truncate)
            keep[3] = mb.keep_pairs(gy, fits[3], gy, fits[3], eps, truncate)
        return keep

    def masks(self, pots, eps) -> tuple:
        """Cluster keep masks for the current potentials, and the fits they came from."""
        fits = self.fits_of(pots, eps)
        return self.keeps(fits, eps), fits

    def covers(self, fits, pots) -> list:
        """The fits raised to cover the potentials ``pots`` at the points (bounds.cover)."""
        return [None if p is None else mb.cover(g, f, p) for f, p, g in zip(fits, pots, self.geometries())]

    def ranges_of(self, keep) -> Ranges:
        """The four plans' column ranges (kernels/block_ranges.py) from their cluster masks, each
        built at its first use (the Taylor pass streams the masks' pairs instead)."""
        cx, cy = self.cx, self.cy
        return Ranges(keep, (cx.label, cy.label, cx.label, cy.label), (cy.start, cx.start, cx.start, cy.start),
                      self.block_m)


_RELEASED = object()


class Ranges:
    """The four plans' column ranges (clusters.kept_ranges), each built at its first use
    and kept: the direct passes, the gradient's fallback and the trace need them; a sweep whose
    plans all take the Taylor pass does not (two ~1 ms kernels per mask at 2^20)."""

    def __init__(self, keep, labels, starts, block_m):
        self.keep, self.labels, self.starts, self.block_m = keep, labels, starts, block_m
        self.built = [None] * len(keep)

    def __getitem__(self, k):
        if self.built[k] is None and self.keep[k] is not None:
            if self.keep[k] is _RELEASED:
                raise RuntimeError(f"multiscale solve: plan {k}'s column ranges were not built during the solve and "
                                   "its mask is released (a gradient side the solve was not told about: `means`)")
            self.built[k] = kept_ranges(self.keep[k], self.labels[k], self.block_m, self.starts[k])
        return self.built[k]

    def release(self) -> None:
        """Drop the masks (K_x K_y bytes each, kept alive by the result otherwise): every range the
        gradient may ask for was built during the solve (the sides in ``means`` had their means or
        their direct passes' ranges); an unbuilt one then raises instead of being rebuilt."""
        self.keep = tuple(None if k is None else _RELEASED for k in self.keep)

    def build(self, ks) -> None:
        """Build the ranges of plans ``ks`` now, with one host read for all of them."""
        ks = [k for k in ks if self.built[k] is None and self.keep[k] is not None]
        if any(self.keep[k] is _RELEASED for k in ks):
            self[next(k for k in ks if self.keep[k] is _RELEASED)]  # raises
        made = kept_ranges_many([(self.keep[k], self.labels[k], self.block_m, self.starts[k]) for k in ks])
        for k, r in zip(ks, made):
            self.built[k] = r

    def all(self) -> tuple:
        self.build(range(len(self.keep)))
        return tuple(self[k] for k in range(len(self.keep)))

    def getter(self, k):
        """A function giving plan k's ranges (None when the plan is not there)."""
        return lambda: self[k]


def kept_fraction(keep: Tensor) -> Tensor:
    """The fraction of True in a (K_x, K_y) mask (float64, 0-d, on its device), counted 1024 rows at
    a time: a whole-mask sum (or count_nonzero) first casts it to int64, 8 bytes per cluster pair
    (1.9 GB at K = 15 625)."""
    counts = torch.stack([c.sum() for c in keep.split(1024)]) if keep.shape[0] else keep.new_zeros(1, dtype=torch.int64)
    return counts.sum().double() / max(keep.numel(), 1)
