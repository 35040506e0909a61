"""Multiscale (coarse-to-fine, block-sparse) Sinkhorn for d <= 3: the rules both frontends share.
No framework imports.

GeomLoss's ``backend="multiscale"`` (its names, defaults and rules; p = 2, C = |x - y|^2 / 2):

* **Clusters.** Each cloud is cut by a voxel grid of side ``cluster_scale`` anchored at the
  joint bounding box's lower corner; the points of a voxel form a cluster, with the sum of their
  weights and their weighted mean (the plain mean when the weights sum to 0) as the coarse point.
  Default ``cluster_scale = diameter / (sqrt(d) * 2000^(1/d))`` (~2000 clusters on a cube).
* **Coarse to fine.** The eps-scaling schedule runs on the clusters while
  ``cluster_scale^2 <= eps`` (the grid is finer than the blur); at the first schedule step where
  ``cluster_scale^2 > eps`` (not counting the first two steps) the solve jumps to the points.
* **Truncation.** At the jump, with the coarse potentials (f_k, g_l) and the coarse cost C_kl
  between centroids, the cluster pair (k, l) is kept iff ``f_k + g_l > C_kl - truncate * eps``;
  the fine solve streams only the kept pairs' blocks (kernels/lse_blocksparse.py,
  kernels/apply_blocksparse.py). Beyond GeomLoss, each cluster also keeps its best partner
  (largest f_k + g_l - C_kl), so no point is left with an empty sum. ``truncate=None`` keeps
  every block (then only the coarse phase differs from the dense solve).
* **What truncation drops.** A dropped pair's plan entries are P_ij = a_i b_j exp((f_i + g_j -
  C_ij) / eps) with C_ij >= (max(0, |x_k - y_l| - r_k - r_l))^2 / 2 (r: the clusters' radii
  around their centroids), f_i <= max_{i in k} f_i, g_j <= max_{j in l} g_j; summing the bound
  over the dropped pairs gives the reported bound on the dropped plan mass
  (:func:`dropped_mass_bound_terms` states the per-pair term).
"""

from __future__ import annotations

import math

from .checks import positive

MAX_DIM = 3
DEFAULT_TRUNCATE = 5.0
CLUSTERS_PER_CUBE = 2000.0


def check_dim(d: int) -> None:
    if d > MAX_DIM:
        raise ValueError(f"backend='multiscale' clusters points on a voxel grid and supports d <= {MAX_DIM}; "
                         f"got points of dimension d={d}; use backend='online' (the dense streaming solve)")


def truncate_value(truncate) -> float | None:
    """``truncate``: a positive number (in units of eps) or None (no truncation, exact)."""
    return None if truncate is None else positive("truncate", truncate)


def cluster_scale_value(cluster_scale, diameter: float, d: int) -> float:
    """The voxel side: the given ``cluster_scale`` (> 0) or GeomLoss's default for this diameter."""
    if cluster_scale is not None:
        return positive("cluster_scale", cluster_scale)
    if not (diameter > 0 and math.isfinite(diameter)):
        raise ValueError(f"the clouds' diameter must be finite and > 0 to pick a default cluster_scale; "
                         f"got {diameter}: pass cluster_scale explicitly")
    return diameter / (math.sqrt(d) * CLUSTERS_PER_CUBE ** (1.0 / d))


def jump_index(eps_list: list[float], cluster_scale: float) -> int:
    """Index of the last schedule step solved on the clusters: the step before the first eps of
    ``eps_list[2:]`` below ``cluster_scale^2``; the last index when the grid never gets coarser
    than the blur (the fine problem is then only extrapolated and differentiated)."""
    for i, eps in enumerate(eps_list[2:]):
        if cluster_scale ** 2 > eps:
            return i + 1
    return len(eps_list) - 1


def grid_shape(extent: list[float], cluster_scale: float, max_cells: int = 1 << 24) -> tuple[int, ...]:
    """Voxels per axis covering a bounding box of the given extents (at least one per axis)."""
    shape = tuple(int(math.floor(e / cluster_scale)) + 1 for e in extent)
    if math.prod(shape) > max_cells:
        raise ValueError(f"cluster_scale={cluster_scale:g} cuts the clouds' bounding box (extent "
                         f"{[round(e, 6) for e in extent]}) into {math.prod(shape)} voxels, more than "
                         f"{max_cells}; pass a larger cluster_scale")
    return shape


def keep_rule(f_k: float, g_l: float, c_kl: float, eps: float, truncate: float | None) -> bool:
    """GeomLoss's truncation test for one cluster pair (the frontends apply it array-wise)."""
    return truncate is None or f_k + g_l > c_kl - truncate * eps


def dropped_mass_bound_terms(wa: float, wb: float, fmax: float, gmax: float, dist: float, ra: float, rb: float,
                             eps: float) -> float:
    """Upper bound on the plan mass of one dropped cluster pair (module docstring): total weights
    wa, wb, the potentials' maxima, the centroids' distance and the clusters' radii."""
    if wa <= 0 or wb <= 0:
        return 0.0
    gap = max(0.0, dist - ra - rb)
    expo = min(700.0, (fmax + gmax - 0.5 * gap * gap) / eps)
    return wa * wb * math.exp(expo)
