"""Truncation masks of the multiscale solve from a rigorous bound (torch; the rule is
``ot_triton_jax.core.multiscale_rules``'s).

For a cluster k of one cloud (points x_i = c_k + u_i, |u_i| <= r_k, c_k the plain mean) and a
potential f on its points, the least-squares affine fit f_i = alpha_k + <beta_k, u_i> + rho_i has
a residual |rho_i| <= rho_k measured exactly (any beta would give a valid bound; least squares
makes it tight). With C = |x - y|^2 / 2 and D = c_k - c_l, for every i in k and j in l:

    f_i + g_j - C_ij <= U_kl = alpha_k + alpha_l - |D|^2 / 2 + min(L1, L2, L3) + rho_k + rho_l

with A = |beta_k - D|, B = |beta_l + D|, S = |beta_k + beta_l|, R = r_k + r_l and
q(a) = max over |w| <= R of (a |w| - |w|^2 / 2) = a^2 / 2 if a <= R else a R - R^2 / 2:

    L1 = A r_k + B r_l          (expand |D + u - v|^2 / 2 and drop -|u - v|^2 / 2 <= 0),
    L2 = q(A) + S r_l           (write the linear terms in w = u - v and v: <beta_k - D, w>
                                 - |w|^2 / 2 + <beta_k + beta_l, v>, |w| <= R, |v| <= r_l),
    L3 = q(B) + S r_k           (the same in w and u).

L2 and L3 keep the cost's curvature: near a potential's fixed point the betas are small and they
are about R^2 / 2 below L1 (the mask's boundary moves in by about that). The
pair (k, l) is kept iff
U_kl > -truncate * eps, or it is the best pair (largest U) of its row or column, so no point is
left with an empty sum. The plan mass of a dropped pair, a_i b_j exp((f_i + g_j - C_ij) / eps)
summed over its points, is at most W_k W_l exp(U_kl / eps) (W: summed weights); the sum over the
dropped pairs is the reported bound. The fits are float64 (n-sized scatter sums); the pair grid
runs in the kernels of ``ot_triton_jax.core.kernels.pair_bound`` (float32 with a safety margin);
the only (K_x, K_y) array is the int8 keep mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ot_triton_jax.core import multiscale_calls, runtime

from ..kernel_ops import params, run
from .clusters import Clusters


@dataclass(frozen=True)
class Geometry:
    """One sorted cloud's clusters for the bound: plain means ``center`` (K, d), radii ``radius``
    (K,) around them, offsets ``u`` (n, d) of the points from their centre, the second moments ``moment`` (K, d, d)
    of the offsets and the inverses ``inv_moment`` of their ridge-regularised versions (the fit),
    and the summed weights ``weight`` (K,)."""

    label: Tensor
    center: Tensor
    radius: Tensor
    u: Tensor
    moment: Tensor
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
    # a small ridge solves clusters of <= d points or flat ones too (any beta gives a valid bound:
    # rho is measured; fit() refines away the ridge's bias); inv, not pinv, whose batched
    # eigensolver was suspected of ~0.5 MB per cluster on the H100
    ridge = 1e-8 * moment.diagonal(dim1=1, dim2=2).sum(1) + 1e-30
    # inv_ex: no error check, so no wait for the device (the ridge keeps every system regular)
    inv = torch.linalg.inv_ex(moment + ridge[:, None, None] * torch.eye(d, dtype=torch.float64, device=pts.device))[0]
    weight = torch.zeros(k, dtype=torch.float64, device=pts.device).index_add_(0, lab, weights_sorted.double())
    return Geometry(label=lab, center=center, radius=radius, u=u, moment=moment, inv_moment=inv, weight=weight, count=count)


def fit(geo: Geometry, pot_sorted: Tensor) -> Fit:
    """The affine fit of one potential (in cluster order) on each cluster, with its exact residual."""
    p, lab = pot_sorted.double(), geo.label
    k = geo.center.shape[0]
    alpha = torch.zeros(k, dtype=torch.float64, device=p.device).index_add_(0, lab, p) / geo.count
    dev = p - alpha[lab]
    rhs = torch.zeros_like(geo.center).index_add_(0, lab, geo.u * dev[:, None])
    beta = torch.einsum("kij,kj->ki", geo.inv_moment, rhs)
    # one refinement step: the ridge's relative bias ridge/lambda on the spanned directions squares
    beta = beta + torch.einsum("kij,kj->ki", geo.inv_moment, rhs - torch.einsum("kij,kj->ki", geo.moment, beta))
    resid = (dev - (geo.u * beta[lab]).sum(1)).abs()
    rho = torch.zeros(k, dtype=torch.float64, device=p.device).scatter_reduce_(
        0, lab, resid, reduce="amax", include_self=True)
    return Fit(alpha=alpha, beta=beta, rho=rho)


def lifted_fit(geo: Geometry, delta: Tensor, value: Tensor, to_mean: Tensor) -> Fit:
    """Upper-bound fits of a lifted potential without the potential itself: the coarse-to-fine
    lift f(x) = -eps log sum_l B_l exp((G_l - |x - c_l|^2 / 2) / eps) on each cluster k, from its
    value ``value`` (K,) = f(cbar_k) at the cluster's centroid cbar_k, ``to_mean`` (K, d) =
    cbar_k - m_k with m_k = sum_l w_l c_l the softmin mean there (w_l the softmin weights at cbar_k),
    and ``delta`` (K, d) = c_k - cbar_k (c_k the plain mean, the fits' expansion point). Jensen's
    inequality on the softmin of C(x, c_l) - C(cbar_k, c_l) = <x - cbar_k, cbar_k - c_l> + |x - cbar_k|^2 / 2
    gives, for every x,

        f(x) <= f(cbar_k) + <x - cbar_k, cbar_k - m_k> + |x - cbar_k|^2 / 2,

    so for x = c_k + u, |u| <= r_k: f(x) <= alpha + <beta, u> + rho with beta = c_k - m_k =
    delta + to_mean, alpha = value + <delta, to_mean> + |delta|^2 / 2 + r_k^2 / 4 and rho = r_k^2 / 4.
    Only the upper side holds (the truncation bound U_kl uses only that side): the solve builds the
    first fine sweep's masks from these, before the lift, and the lift streams those masks' pairs;
    the dropped-mass bound is taken from :func:`fit` of the lifted potentials (two-sided, exact)."""
    delta, to_mean, value = delta.double(), to_mean.double(), value.double()
    quarter = 0.25 * geo.radius * geo.radius
    alpha = value + (delta * to_mean).sum(1) + 0.5 * (delta * delta).sum(1) + quarter
    return Fit(alpha=alpha, beta=delta + to_mean, rho=quarter)


def predict(geo: Geometry, f: Fit) -> Tensor:
    """The fit's upper side at every point, alpha_k + <beta_k, u_i> + rho_k (float64, (n,))."""
    lab = geo.label
    return f.alpha[lab] + (geo.u * f.beta[lab]).sum(1) + f.rho[lab]


def cover(geo: Geometry, f: Fit, pot_sorted: Tensor) -> Fit:
    """``f``'s alpha and beta with rho raised (or lowered) to the largest residual of ``pot_sorted``
    at the points: pot_i <= alpha_k + <beta_k, u_i> + rho_k at every point, measured. One-sided (the
    truncation bound U_kl and the dropped mass use only the upper side): a valid bound for a
    potential that was not fitted, here the lifted and last potentials of a sweep whose masks came
    from :func:`lifted_fit` (the potentials' own least-squares fits interpolate a few points per
    cluster with arbitrary slopes, and a bound from them need not follow the mask)."""
    lab = geo.label
    resid = pot_sorted.double() - f.alpha[lab] - (geo.u * f.beta[lab]).sum(1)
    rho = torch.full_like(f.rho, float("-inf")).scatter_reduce_(0, lab, resid, reduce="amax", include_self=True)
    return Fit(alpha=f.alpha, beta=f.beta, rho=rho)


def _arrays(gx: Geometry, fx: Fit, gy: Geometry, fy: Fit, eps: float, truncate: float | None) -> dict:
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    thr = -truncate * eps if truncate is not None else float("-inf")
    return {"cx": f32(gx.center), "ax": f32(fx.alpha), "bx": f32(fx.beta), "rx": f32(gx.radius), "hx": f32(fx.rho),
            "wx": f32(gx.weight), "cy": f32(gy.center), "ay": f32(fy.alpha), "by": f32(fy.beta), "ry": f32(gy.radius),
            "hy": f32(fy.rho), "wy": f32(gy.weight),
            "params": params(eps, thr, gx.center.device)}


def keep_pairs(gx: Geometry, fx: Fit, gy: Geometry, fy: Fit, eps: float, truncate: float | None,
               transposed: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """keep (K_x, K_y) bool: U_kl > -truncate eps, or (k, l) the best pair of its row or column;
    every pair when ``truncate`` is None (kernels/pair_bound.py: the mask and the maxima in one
    launch over the pair grid, then the empty rows' and columns' best pairs). ``transposed``:
    (keep, its transpose (K_y, K_x), written by the same launch)."""
    kx, ky, d = gx.center.shape[0], gy.center.shape[0], gx.center.shape[1]
    dev = gx.center.device
    if truncate is None:
        keep = torch.ones(kx, ky, dtype=torch.bool, device=dev)
        return (keep, torch.ones(ky, kx, dtype=torch.bool, device=dev)) if transposed else keep
    arrays = _arrays(gx, fx, gy, fy, eps, truncate)
    gpu = runtime.on_gpu()
    out = run(multiscale_calls.pair_keep(kx, ky, d, gpu, transposed), arrays, dev)
    rowmax, colmax = out[-2:]
    arrays.update(rowbest=rowmax.amax(0).contiguous(), colbest=colmax.amax(0).contiguous())
    run(multiscale_calls.pair_fixup(kx, ky, d, gpu, transposed), arrays, dev)
    return (out[0].view(torch.bool), out[1].view(torch.bool)) if transposed else out[0].view(torch.bool)


def dropped_mass(gx: Geometry, fx: Fit, gy: Geometry, fy: Fit, eps: float, keep: Tensor) -> Tensor:
    """Upper bound on sum over the pairs not in ``keep`` of a_i b_j exp((f_i + g_j - C_ij) / eps):
    sum of W_k W_l exp(U_kl / eps) over them (exactly 0 when every pair is kept; +inf when it
    overflows float32), a float64 0-d tensor on the device (no host read)."""
    kx, ky, d = gx.center.shape[0], gy.center.shape[0], gx.center.shape[1]
    arrays = _arrays(gx, fx, gy, fy, eps, None)
    arrays["keep"] = keep.contiguous().view(torch.int8)
    (parts,) = run(multiscale_calls.pair_dropped(kx, ky, d, runtime.on_gpu()), arrays, gx.center.device)
    # float32 tile sums: raised by 1e-5 (relative) so that rounding cannot make it a non-bound
    return parts.double().sum() * (1.0 + 1e-5)
