"""Truncation masks of the multiscale solve from a rigorous bound (torch; the rule is
``ot_triton_jax.core.multiscale_rules``'s).

For a cluster k of one cloud (points x_i = c_k + u_i, |u_i| <= r_k, c_k the plain mean) and a
potential f on its points, the least-squares affine fit f_i = alpha_k + <beta_k, u_i> + rho_i has
a residual |rho_i| <= rho_k measured exactly (any beta would give a valid bound; least squares
makes it tight). With C = |x - y|^2 / 2 and D = c_k - c_l, for every i in k and j in l:

    f_i + g_j - C_ij <= U_kl = alpha_k + alpha_l - |D|^2 / 2 + |beta_k - D| r_k + |beta_l + D| r_l
                               + rho_k + rho_l

(expand |D + u - v|^2 / 2 and drop |u - v|^2 / 2 >= 0). The pair (k, l) is kept iff
U_kl > -truncate * eps, or it is the best pair (largest U) of its row or column, so no point is
left with an empty sum. The plan mass of a dropped pair, a_i b_j exp((f_i + g_j - C_ij) / eps)
summed over its points, is at most W_k W_l exp(U_kl / eps) (W: summed weights); the sum over the
dropped pairs is the reported bound. Everything here is float64 and at most (K_x, K_y) in size,
computed in row chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .multiscale_clusters import Clusters

_CHUNK = 1 << 22  # elements of one (rows, K_y, d) slab of the pair bound


@dataclass(frozen=True)
class Geometry:
    """One sorted cloud's clusters for the bound: plain means ``center`` (K, d), radii ``radius``
    (K,) around them, offsets ``u`` (n, d) of the points from their centre, the inverse second
    moments ``inv_moment`` (K, d, d) of the fit, and the summed weights ``weight`` (K,)."""

    label: Tensor
    center: Tensor
    radius: Tensor
    u: Tensor
    inv_moment: Tensor
    weight: Tensor
    count: Tensor


@dataclass(frozen=True)
class Fit:
    """alpha (K,), beta (K, d), rho (K,) of one potential on one cloud's clusters (float64)."""

    alpha: Tensor
    beta: Tensor
    rho: Tensor


def geometry(points_sorted: Tensor, weights_sorted: Tensor, c: Clusters) -> Geometry:
    """The per-cluster quantities the fits and bounds need (points in cluster order)."""
    pts, lab, k, d = points_sorted.double(), c.label, c.k, points_sorted.shape[1]
    count = (c.start[1:] - c.start[:-1]).double()
    center = torch.zeros(k, d, dtype=torch.float64, device=pts.device).index_add_(0, lab, pts) / count[:, None]
    u = pts - center[lab]
    radius = torch.zeros(k, dtype=torch.float64, device=pts.device).scatter_reduce_(
        0, lab, u.norm(dim=1), reduce="amax", include_self=True)
    moment = torch.zeros(k, d, d, dtype=torch.float64, device=pts.device).index_add_(0, lab, u[:, :, None] * u[:, None, :])
    # the pseudo-inverse solves clusters of <= d points or flat ones too (beta stays valid either way)
    inv = torch.linalg.pinv(moment, hermitian=True, rtol=1e-10)
    weight = torch.zeros(k, dtype=torch.float64, device=pts.device).index_add_(0, lab, weights_sorted.double())
    return Geometry(label=lab, center=center, radius=radius, u=u, inv_moment=inv, weight=weight, count=count)


def fit(geo: Geometry, pot_sorted: Tensor) -> Fit:
    """The affine fit of one potential (in cluster order) on each cluster, with its exact residual."""
    p, lab = pot_sorted.double(), geo.label
    k = geo.center.shape[0]
    alpha = torch.zeros(k, dtype=torch.float64, device=p.device).index_add_(0, lab, p) / geo.count
    dev = p - alpha[lab]
    rhs = torch.zeros_like(geo.center).index_add_(0, lab, geo.u * dev[:, None])
    beta = torch.einsum("kij,kj->ki", geo.inv_moment, rhs)
    resid = (dev - (geo.u * beta[lab]).sum(1)).abs()
    rho = torch.zeros(k, dtype=torch.float64, device=p.device).scatter_reduce_(
        0, lab, resid, reduce="amax", include_self=True)
    return Fit(alpha=alpha, beta=beta, rho=rho)


def _pair_bound(gx: Geometry, fx: Fit, gy: Geometry, fy: Fit, rows: slice) -> Tensor:
    """U_kl of the module docstring for the row clusters ``rows`` and every column cluster."""
    D = gx.center[rows, None, :] - gy.center[None, :, :]
    u = (fx.alpha[rows, None] + fy.alpha[None, :] - 0.5 * (D * D).sum(2)
         + (fx.beta[rows, None, :] - D).norm(dim=2) * gx.radius[rows, None]
         + (fy.beta[None, :, :] + D).norm(dim=2) * gy.radius[None, :]
         + fx.rho[rows, None] + fy.rho[None, :])
    return u


def _chunks(gx: Geometry, gy: Geometry):
    kx, ky = gx.center.shape[0], gy.center.shape[0]
    step = max(1, _CHUNK // max(1, ky * gx.center.shape[1]))
    return [slice(r0, min(kx, r0 + step)) for r0 in range(0, kx, step)]


def keep_pairs(gx: Geometry, fx: Fit, gy: Geometry, fy: Fit, eps: float, truncate: float | None) -> Tensor:
    """keep (K_x, K_y) bool: U_kl > -truncate eps, or (k, l) the best pair of its row or column;
    every pair when ``truncate`` is None."""
    kx, ky = gx.center.shape[0], gy.center.shape[0]
    dev = gx.center.device
    if truncate is None:
        return torch.ones(kx, ky, dtype=torch.bool, device=dev)
    keep = torch.empty(kx, ky, dtype=torch.bool, device=dev)
    col_best = torch.full((ky,), -torch.inf, dtype=torch.float64, device=dev)
    col_arg = torch.zeros(ky, dtype=torch.long, device=dev)
    for rows in _chunks(gx, gy):
        u = _pair_bound(gx, fx, gy, fy, rows)
        k = u > -truncate * eps
        k[torch.arange(u.shape[0], device=dev), u.argmax(1)] = True
        best, arg = u.max(0)
        better = best > col_best
        col_best, col_arg = torch.where(better, best, col_best), torch.where(better, arg + rows.start, col_arg)
        keep[rows] = k
    keep[col_arg, torch.arange(ky, device=dev)] = True
    return keep


def dropped_mass(gx: Geometry, fx: Fit, gy: Geometry, fy: Fit, eps: float, keep: Tensor) -> float:
    """Upper bound on sum over the pairs not in ``keep`` of a_i b_j exp((f_i + g_j - C_ij) / eps):
    sum of W_k W_l exp(U_kl / eps) over them (0 when every pair is kept)."""
    if bool(keep.all()):
        return 0.0
    total = torch.zeros((), dtype=torch.float64, device=gx.center.device)
    for rows in _chunks(gx, gy):
        u = _pair_bound(gx, fx, gy, fy, rows)
        mass = gx.weight[rows, None] * gy.weight[None, :] * torch.exp((u / eps).clamp(max=700.0))
        total = total + torch.where(keep[rows], 0.0, mass).sum()
    return float(total)
