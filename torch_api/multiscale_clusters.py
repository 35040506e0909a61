"""Voxel clustering and block lists for the multiscale solve (torch; rules in
``ot_triton_jax.core.multiscale_rules``).

Everything stays on the clouds' device and nothing n x m is formed: the clusters are sorted
voxels (one argsort per cloud), the truncation mask is cluster x cluster (the coarse problem's
size) and the row-block mask handed to the block-sparse kernels is (cdiv(n, BLOCK_M), K_y).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_triton_jax.core import multiscale_rules as rules


@dataclass(frozen=True)
class Clusters:
    """One cloud sorted by voxel.

    ``perm``: sorted position -> original index (points_sorted = points[perm]);
    ``label``: the cluster of each sorted point (non-decreasing, 0..K-1);
    ``start``: int32 (K + 1,), cluster k holds sorted points [start[k], start[k+1]);
    ``weight``: (K,) summed weights; ``centroid``: (K, d) weighted means (plain means where a
    cluster's weight is 0); ``radius``: (K,) the largest distance of a member to its centroid.
    """

    perm: torch.Tensor
    label: torch.Tensor
    start: torch.Tensor
    weight: torch.Tensor
    centroid: torch.Tensor
    radius: torch.Tensor

    @property
    def k(self) -> int:
        return self.weight.shape[0]


def voxel_ids(points: torch.Tensor, lower: torch.Tensor, cluster_scale: float, shape: tuple[int, ...]) -> torch.Tensor:
    """Linear voxel index of every point (row-major over ``shape``) on the grid anchored at ``lower``."""
    cells = torch.floor((points.double() - lower.double()) / cluster_scale).long()
    cells = torch.minimum(cells.clamp_min(0), torch.tensor(shape, device=points.device) - 1)
    ids = cells[:, 0]
    for axis in range(1, points.shape[1]):
        ids = ids * shape[axis] + cells[:, axis]
    return ids


def cluster(points: torch.Tensor, weights: torch.Tensor, lower: torch.Tensor, cluster_scale: float,
            shape: tuple[int, ...]) -> Clusters:
    """Sort one cloud by voxel and reduce each occupied voxel to a weighted centroid."""
    ids = voxel_ids(points, lower, cluster_scale, shape)
    ids_sorted, perm = torch.sort(ids, stable=True)
    _, label, counts = torch.unique_consecutive(ids_sorted, return_inverse=True, return_counts=True)
    k = counts.shape[0]
    start = torch.zeros(k + 1, dtype=torch.int32, device=points.device)
    start[1:] = torch.cumsum(counts, 0).to(torch.int32)
    pts, w = points[perm].double(), weights[perm].double()
    weight = torch.zeros(k, dtype=torch.float64, device=points.device).index_add_(0, label, w)
    wsum = torch.zeros_like(pts[:k]).index_add_(0, label, w[:, None] * pts)
    plain = torch.zeros_like(pts[:k]).index_add_(0, label, pts) / counts[:, None].double()
    centroid = torch.where(weight[:, None] > 0, wsum / weight.clamp_min(torch.finfo(torch.float64).tiny)[:, None],
                           plain)
    dist = (pts - centroid[label]).norm(dim=1)
    radius = torch.zeros(k, dtype=torch.float64, device=points.device).scatter_reduce_(
        0, label, dist, reduce="amax", include_self=True)
    dt = points.dtype
    return Clusters(perm=perm, label=label, start=start, weight=weight.to(dt), centroid=centroid.to(dt),
                    radius=radius.to(dt))


def cluster_pair(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, b: torch.Tensor,
                 cluster_scale: float) -> tuple[Clusters, Clusters]:
    """Both clouds on one grid of side ``cluster_scale`` over their joint bounding box (one host
    read: the box's extent, which sizes the grid)."""
    rules.check_dim(x.shape[1])
    both = torch.cat([x, y])
    lower, upper = both.min(0).values, both.max(0).values
    shape = rules.grid_shape((upper - lower).double().tolist(), cluster_scale)
    return cluster(x, a, lower, cluster_scale, shape), cluster(y, b, lower, cluster_scale, shape)


def keep_clusters(f_c: torch.Tensor, g_c: torch.Tensor, cx: Clusters, cy: Clusters, eps: float,
                  truncate: float | None) -> torch.Tensor:
    """GeomLoss's truncation mask (K_x, K_y) from the coarse potentials (cost |x - y|^2 / 2):
    keep (k, l) iff f_k + g_l > C_kl - truncate * eps, and also each row's and each column's
    best pair (the largest f_k + g_l - C_kl); all True when ``truncate`` is None."""
    if truncate is None:
        return torch.ones(cx.k, cy.k, dtype=torch.bool, device=f_c.device)
    c = 0.5 * torch.cdist(cx.centroid.double(), cy.centroid.double()) ** 2
    score = f_c.double()[:, None] + g_c.double()[None, :] - c
    # beyond GeomLoss's rule: every cluster keeps its best partner, so no row of the fine
    # problem is left with an empty sum (its potential would silently come out 0)
    best = (score == score.max(dim=1, keepdim=True).values) | (score == score.max(dim=0, keepdim=True).values)
    return (score > -truncate * eps) | best


def row_block_mask(keep: torch.Tensor, label: torch.Tensor, block_m: int) -> torch.Tensor:
    """int8 (cdiv(n, block_m), K_y): row block b keeps the union of the kept columns of the
    clusters its sorted rows belong to (contiguous, since rows are sorted by cluster)."""
    n = label.shape[0]
    first = label[::block_m]
    last = label[torch.clamp(torch.arange(block_m - 1, n + block_m - 1, block_m, device=label.device), max=n - 1)]
    counts = torch.zeros(keep.shape[0] + 1, keep.shape[1], dtype=torch.int32, device=keep.device)
    counts[1:] = torch.cumsum(keep.to(torch.int32), 0)
    return ((counts[last + 1] - counts[first]) > 0).to(torch.int8)


def dropped_mass_bound(mask: torch.Tensor, x: torch.Tensor, a: torch.Tensor, f: torch.Tensor, cy: Clusters,
                       y: torch.Tensor, b: torch.Tensor, g: torch.Tensor, eps: float, block_m: int) -> float:
    """Upper bound on sum_ij P_ij over the pairs a row-block mask drops, P_ij = a_i b_j
    exp((f_i + g_j - |x_i - y_j|^2 / 2) / eps) (GeomLoss's plan; x, a, f sorted by cluster as the
    mask's rows, y, b, g as its columns): per dropped (row block, cluster) pair
    ``multiscale_rules.dropped_mass_bound_terms`` with the block's and the cluster's centroid,
    radius, total weight and largest potential. (cdiv(n, block_m), K_y) work, float64."""
    n, nb = x.shape[0], mask.shape[0]
    blk = torch.arange(n, device=x.device) // block_m
    xd, ad, fd = x.double(), a.double(), f.double()
    wb_ = torch.zeros(nb, dtype=torch.float64, device=x.device).index_add_(0, blk, ad)
    cnt = torch.zeros(nb, dtype=torch.float64, device=x.device).index_add_(0, blk, torch.ones_like(ad))
    cen_b = torch.zeros(nb, x.shape[1], dtype=torch.float64, device=x.device).index_add_(0, blk, xd) / cnt[:, None]
    rad_b = torch.zeros(nb, dtype=torch.float64, device=x.device).scatter_reduce_(
        0, blk, (xd - cen_b[blk]).norm(dim=1), reduce="amax", include_self=True)
    neg = torch.full((nb,), -torch.inf, dtype=torch.float64, device=x.device)
    fmax = neg.scatter_reduce(0, blk, torch.where(ad > 0, fd, -torch.inf), reduce="amax", include_self=True)
    lab = cy.label
    gd, bd = g.double(), b.double()
    gmax = torch.full((cy.k,), -torch.inf, dtype=torch.float64, device=x.device).scatter_reduce(
        0, lab, torch.where(bd > 0, gd, -torch.inf), reduce="amax", include_self=True)
    # the cluster's own centroid and radius around the *plain* mean of its points (a ball that holds them)
    cnt_y = (cy.start[1:] - cy.start[:-1]).double()
    cen_y = torch.zeros(cy.k, y.shape[1], dtype=torch.float64, device=x.device).index_add_(0, lab, y.double())
    cen_y = cen_y / cnt_y.clamp_min(1)[:, None]
    rad_y = torch.zeros(cy.k, dtype=torch.float64, device=x.device).scatter_reduce_(
        0, lab, (y.double() - cen_y[lab]).norm(dim=1), reduce="amax", include_self=True)
    wy = torch.zeros(cy.k, dtype=torch.float64, device=x.device).index_add_(0, lab, bd)
    gap = (torch.cdist(cen_b, cen_y) - rad_b[:, None] - rad_y[None, :]).clamp_min(0.0)
    expo = ((fmax[:, None] + gmax[None, :] - 0.5 * gap * gap) / eps).clamp(max=700.0)
    term = wb_[:, None] * wy[None, :] * torch.exp(expo)
    term = torch.where((wb_[:, None] > 0) & (wy[None, :] > 0) & (mask == 0), term, 0.0)
    return float(term.sum())
