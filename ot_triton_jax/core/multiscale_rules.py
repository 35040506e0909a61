"""Multiscale (coarse-to-fine, block-sparse) Sinkhorn for d <= 3: the rules both frontends share.
No framework imports.

GeomLoss's ``backend="multiscale"`` (its names, defaults and rules; p = 2, C = |x - y|^2 / 2):

* **Clusters.** Each cloud is cut by a voxel grid of side ``cluster_scale`` anchored at the
  joint bounding box's lower corner; the points of a voxel form a cluster, with the sum of their
  weights and their weighted mean (the plain mean when the weights sum to 0) as the coarse point.
  GeomLoss's default ``cluster_scale = diameter / (sqrt(d) * 2000^(1/d))`` (~2000 clusters on a
  cube) with ``tol=None``; with a tolerance, finer where the blur is small
  (:func:`cluster_scale_value`) and where the clouds fill little of their bounding box
  (:func:`finer_cluster_scale`).
* **Coarse to fine.** The eps-scaling schedule runs on the clusters while
  ``cluster_scale^2 <= eps`` (the grid is finer than the blur); at the first schedule step where
  ``cluster_scale^2 > eps`` (not counting the first two steps) the solve jumps to the points.
* **Truncation.** Before every sweep on the points (eps_k of the schedule, then the finishing
  sweeps and the last extrapolation at blur^2), the cluster pair (k, l) is kept iff an upper
  bound U_kl >= max_{i in k, j in l} (f_i + g_j - C_ij) from the current potentials exceeds
  ``-truncate * eps`` (GeomLoss's test f + g > C - truncate eps, applied to the bound over the
  pair's points instead of to the centroids, and refreshed at every eps instead of once at the
  jump); each cluster also keeps its best partner, so no point is left with an empty sum.
  U_kl comes from per-cluster affine fits of the potentials with their exact residuals
  (``torch_api.multiscale.bounds`` states it). ``truncate=None`` keeps every block.
* **What truncation drops.** The plan mass a_i b_j exp((f_i + g_j - C_ij) / eps) of a dropped
  pair is at most W_k W_l exp(U_kl / eps); the sum over the dropped pairs of the last
  extrapolation's four plans (x-y, y-x, x-x, y-y) is the reported ``dropped_mass_bound``. Each
  truncated potential of the last extrapolation differs from the untruncated one (same inputs)
  by at most eps times its plan's dropped mass in the a-weighted sum, so the loss is within
  eps * dropped_mass_bound of the untruncated last extrapolation: exact to float32 when that is
  below 2^-24 |loss|.
* **Finishing.** GeomLoss runs one sweep per eps and jumps to the points at ``jump_index``.
  With ``tol`` set, the schedule runs on the clusters to the end, the clusters are converged at
  blur^2 (to COARSE_TOL_FRACTION * tol), the potentials are lifted to the points, and the solve
  goes on with finishing steps at blur^2 (one over-relaxed, then Anderson-accelerated; the coarse
  convergence at blur^2 takes the same steps) until the largest marginal error of the four truncated plans,
  ||P 1 - a||_1 with P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps), is at most ``tol`` (at most
  ``MAX_FINISH_SWEEPS``; then it warns). The untruncated plan's marginal error is at most the
  reported ``marginal_error`` plus the dropped mass.
* **Relaxed marginals** (:func:`relaxed_rows`): GeomLoss's ``reach`` (rho_x = rho_y = reach^2) and
  OTT's tau_a, tau_b (rho = eps tau / (1 - tau), on the weights a^tau_a, b^tau_b: the same damped
  problem, see :func:`ott_relaxed_weights`). rho stays fixed along the schedule, every update of a
  side is damped by tau_k = rho / (rho + eps_k) (kernels' RELAX_AT), the errors measure the relaxed
  marginal a exp(-f / rho). The plan keeps its form a_i b_j exp((f_i + g_j - C_ij) / eps), so U_kl
  and the dropped mass W_k W_l exp(U_kl / eps) bound it as before; but its rows sum to
  r_i = a_i exp(-f_i / rho), not a_i, and the f-update normalises S_i = sum_j b_j exp((g_j - C_ij)
  / eps) = exp(-f~_i / eps) with f~ = f / tau (the undamped potential): a dropped term's share of
  S_i is b_j exp((f~_i + g_j - C_ij) / eps), so the test must see f / tau on the updated side. The
  masks and bounds therefore fit the bound potentials h = max(p, p / tau) of every side
  (:func:`bound_potential`; h = p when strict): h >= p and h >= p / tau, so one test
  U_kl(h_f, h_g) > -truncate eps covers the f- and the g-update (and the self plans) at once. The
  truncated update f_t = -tau eps log S_t (S_t <= S over the kept blocks, f_t >= f) satisfies
  0 <= f_t,i - f_i = tau eps log(1 + D_i / S_t,i) <= tau eps D_i / S_t,i with D_i the dropped part,
  and D_i / S_t,i = sum_{j dropped} b_j exp((f_t,i / tau + g_j - C_ij) / eps): summed with the
  weights a_i, the dropped mass of the plan from (h(f_t), h(g_old)), at most the reported
  ``dropped_mass_bound``. So each last potential is within tau eps * bound of the untruncated one
  in the a-weighted L1 sum; GeomLoss's relaxed loss terms (rho + eps/2)(1 - exp(-f / rho)) have
  slope (1 + eps / (2 rho)) exp(-f / rho), so the loss moves by at most eps * bound times that
  slope's largest value at the untruncated potentials (which lie below the truncated ones).
  Not relaxed here: one-sided reach_x / reach_y (rho_x != rho_y: split self problems and a
  translation, core/unbalanced.py), the Taylor pass, the truncated lift and the fused mean pass (the
  solve takes the direct passes), second derivatives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .checks import positive

MAX_DIM = 3
DEFAULT_TRUNCATE = 5.0
DEFAULT_TOL = 5e-3  # the finishing sweeps' marginal-error target (flash-sinkhorn's multiscale default)
MAX_FINISH_SWEEPS = 200
MAX_COARSE_SWEEPS = 1000  # finishing steps on the clusters (cheap: K x K kernels)
COARSE_TOL_FRACTION = 0.25  # the clusters are converged to this fraction of tol before the lift
FINISH_OMEGA = 1.4  # over-relaxation of the finishing steps (from a float64 study)
ANDERSON_DEPTH = 5  # Anderson history of the finishing steps (float64 study; docs/performance.md)
ANDERSON_RESTART = 2.0  # restart the history when the marginal error exceeds this times its best
CLUSTERS_PER_CUBE = 2000.0
# default voxel side in blurs when a tolerance is set (H100 sweeps; docs/performance.md). With the Taylor pass
# at order 5, uniform clouds at 2^20 / 2^22 take 103-105 / 262 ms at 0.84 against 114-123 / 285 ms at 0.8, the
# first sweep's marginal error 4.4e-3 against 3.9e-3 (tol = 5e-3); at 0.92 it needs a second sweep
CELL_BLURS = 0.84
MAX_DEFAULT_CLUSTERS = 16384.0
# The Taylor pass (kernels/taylor_blocksparse.py, docs/performance.md): its orders, cheapest first
# (d = 3: order 5 is R = 64 monomials, order 7 R = 128, twice the products and the moments' bytes);
# the largest worst-case relative error per pair weight it may leave, TAYLOR_TOL_FRACTION of the
# solve's tolerance and at most TAYLOR_MAX_BOUND (taylor_order); and the mean points per cluster on
# both sides below which the direct pass is faster (H100: 17 per cluster 4x slower, 67 1.9x faster,
# 268 8.8x faster)
TAYLOR_ORDERS = (5, 7)
TAYLOR_TOL_FRACTION = 0.25
TAYLOR_MAX_BOUND = 1.25e-3
TAYLOR_MIN_POINTS = 48.0
# ... and with the gradient's softmin mean (the rows' monomials and their derivatives stacked, G groups
# per row, 128 / G rows per product). H100, uniform clouds, the x -> y pass at 67 points per cluster:
# 28.5 ms at order 5 against the direct fused pass's 36.1 (order 7: 36.1; docs/performance.md)
TAYLOR_MEAN_MIN_POINTS = 48.0
# The truncated coarse-to-fine lift (torch_api/multiscale/lift.py: the first fine sweep's masks from
# bounds at the centroids, the lift over their pairs) against the dense n x K lift: it adds a cluster-level
# plan pass and a pair list per lift and keeps ~3% more pairs in the first sweep, and saves the dense lift's
# n K exponentials. H100, uniform clouds: 4 / 17 / 67 / 268 points per cluster
# +1.3 / ~0 / -11 / -55 ms
LIFT_TRUNCATED_MIN_POINTS = 32.0


def check_dim(d: int) -> None:
    if d > MAX_DIM:
        raise ValueError(f"backend='multiscale' clusters points on a voxel grid and supports d <= {MAX_DIM}; "
                         f"got points of dimension d={d}; use backend='online' (the dense streaming solve)")


def truncate_value(truncate) -> float | None:
    """``truncate``: a positive number (in units of eps) or None (no truncation, exact)."""
    return None if truncate is None else positive("truncate", truncate)


def tol_value(tol) -> float | None:
    """``tol``: a positive marginal-error target for the finishing sweeps, or None (GeomLoss's
    schedule alone: one sweep per eps, no check)."""
    return None if tol is None else positive("tol", tol)


def reject_tol(given: bool, tol, backend) -> None:
    """``tol`` only means something with ``backend="multiscale"``."""
    if given and backend != "multiscale":
        raise ValueError(f"tol={tol!r} only has a meaning with backend='multiscale' (the finishing sweeps' "
                         "marginal-error target); drop it or pass backend='multiscale'")


def cluster_scale_value(cluster_scale, diameter: float, d: int, blur: float | None = None) -> float:
    """The voxel side: the given ``cluster_scale`` (> 0), else the default. GeomLoss's default is
    diameter / (sqrt(d) 2000^(1/d)) (~2000 clusters on a cube); with ``blur`` (the solve with a
    tolerance) ours is finer where the blur is small: min(GeomLoss's, max(CELL_BLURS * blur,
    diameter / (sqrt(d) MAX_DEFAULT_CLUSTERS^(1/d)))). Clusters about one blur wide make the coarse
    solution, lifted to the points, meet a 5e-3 tolerance without finishing steps and make the
    truncation masks 2x tighter; the cap keeps the cluster-level arrays (an int8 K x K keep mask per
    problem) small (docs/performance.md)."""
    if cluster_scale is not None:
        return positive("cluster_scale", cluster_scale)
    if not (diameter > 0 and math.isfinite(diameter)):
        raise ValueError(f"the clouds' diameter must be finite and > 0 to pick a default cluster_scale; "
                         f"got {diameter}: pass cluster_scale explicitly")
    geomloss = diameter / (math.sqrt(d) * CLUSTERS_PER_CUBE ** (1.0 / d))
    if blur is None:
        return geomloss
    return min(geomloss, max(CELL_BLURS * blur, diameter / (math.sqrt(d) * MAX_DEFAULT_CLUSTERS ** (1.0 / d))))


def finer_cluster_scale(scale: float, blur: float, occupied) -> float:
    """The default voxel side with a tolerance, refined for clouds that fill little of their bounding
    box (surfaces, Gaussians): halved while the halved grid's occupied cells (``occupied(side)``: the
    larger cloud's count) stay within MAX_DEFAULT_CLUSTERS and the side stays >= CELL_BLURS * blur.
    The box-based rule budgets MAX_DEFAULT_CLUSTERS cells for the whole box; on a sphere's surface or a
    Gaussian most of them are empty, the coarse problem is then much coarser than the blur and its
    lifted solution needs finishing sweeps on the points. A cube filled uniformly keeps its side."""
    floor = CELL_BLURS * blur
    while scale / 2.0 >= floor and occupied(scale / 2.0) <= MAX_DEFAULT_CLUSTERS:
        scale /= 2.0
    return scale


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


# The OTT-convention ``sinkhorn(..., multiscale=MultiscaleOptions())`` (both frontends).
# OTT's problem: C_ij = |x_i - y_j|^2 / scale_cost, epsilon absolute, P_ij = exp((f_i + g_j - C_ij)/eps).
# It is the multiscale solve's (C = |x - y|^2 / 2, eps = blur^2) on the points scaled by
# sqrt(2 / scale_cost), with blur = sqrt(epsilon), without debiasing, finishing to tol = threshold;
# OTT's potentials are GeomLoss's plus eps log a (eps log b), and its dual objective
# reg_ot_cost = <a, f - eps log a> + <b, g - eps log b> + eps (sum a sum b - sum P) is taken with
# sum P = sum a (as the dense solver's "tf32" path does; exact after an f-update, within the
# marginal error otherwise).

@dataclass(frozen=True)
class MultiscaleOptions:
    """Options of the multiscale solve behind the OTT-convention ``sinkhorn`` (d <= 3): GeomLoss's
    ``scaling`` (the eps-schedule's ratio in blur = sqrt(eps) per step, in (0, 1)), ``cluster_scale``
    (voxel side in the problem's own units, None: the default rule on the scaled points) and
    ``truncate`` (in units of eps, None: keep every block)."""

    scaling: float = 0.5
    cluster_scale: float | None = None
    truncate: float | None = DEFAULT_TRUNCATE

    def __post_init__(self):
        s = self.scaling
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 < float(s) < 1.0:
            raise ValueError(f"MultiscaleOptions.scaling must be a number in (0, 1), got {s!r}")
        object.__setattr__(self, "scaling", float(s))
        if self.cluster_scale is not None:
            object.__setattr__(self, "cluster_scale", positive("MultiscaleOptions.cluster_scale", self.cluster_scale))
        object.__setattr__(self, "truncate", truncate_value(self.truncate))


def ott_to_geomloss(epsilon: float, scale_cost: float) -> tuple[float, float]:
    """(blur, point scale k): OTT's problem at (epsilon, scale_cost) is GeomLoss's p = 2 problem
    at blur = sqrt(epsilon) on the points k x, k y with k = sqrt(2 / scale_cost)."""
    return math.sqrt(epsilon), math.sqrt(2.0 / scale_cost)


_LOOP_DEFAULTS = {"inner_iterations": 10, "min_iterations": 0, "max_iterations": 2000}


def reject_dense_options(**given) -> None:
    """``sinkhorn(..., multiscale=...)`` has its own schedule and stopping rule: the dense loop's
    options (iterations at non-default values, ``init``, ``implicit``) have no meaning there."""
    bad = [k for k, v in given.items() if (v != _LOOP_DEFAULTS[k] if k in _LOOP_DEFAULTS else v is not None)]
    if bad:
        raise ValueError(f"{', '.join(sorted(bad))}: not meaningful with multiscale=MultiscaleOptions(...) (its "
                         "eps-schedule and the marginal-error threshold decide the sweeps; its derivatives are "
                         "envelope ones): leave them at their defaults or drop multiscale=")


_PLAN_ONLY = {"apply": "P v", "marginal": "the plan's marginals", "transport_mass": "sum P"}
POTENTIAL_DERIVATIVES = ("derivatives of f and g from sinkhorn(..., multiscale=...) are not implemented (only "
                         "reg_ot_cost is differentiable there, with its HVP): use the dense solver (drop "
                         "multiscale=) for the implicit derivatives of the potentials")


def plan_only(name: str) -> str:
    """The error of a dense-solver output method that ``sinkhorn(..., multiscale=...)`` lacks."""
    return (f"{name} is not available from sinkhorn(..., multiscale=...): its plan lives on the kept blocks of "
            f"the last sweep only; use the dense solver (drop multiscale=) for {_PLAN_ONLY[name]}")


class MultiscaleOutputMethods:
    """What both frontends' ``MultiscaleSinkhornOutput`` share with the dense output's interface:
    ``potentials``; ``apply``, ``marginal`` and ``transport_mass`` raise (:func:`plan_only`)."""

    @property
    def potentials(self):
        return self.f, self.g

    def apply(self, *_, **__):
        raise NotImplementedError(plan_only("apply"))

    def marginal(self, *_, **__):
        raise NotImplementedError(plan_only("marginal"))

    @property
    def transport_mass(self):
        raise NotImplementedError(plan_only("transport_mass"))


def taylor_bound(t: float, p: int) -> float:
    """The relative error of one pair's term in the Taylor pass of order p, t = r_k r_l / eps: the
    remainder of exp(z) = sum_{m <= p} z^m / m! for |z| <= t is at most t^(p+1) / (p+1)! e^t."""
    return t ** (p + 1) / math.factorial(p + 1) * math.exp(t)


def taylor_limit(tol: float | None) -> float:
    """The largest worst-case relative error per pair weight the Taylor pass may leave:
    TAYLOR_TOL_FRACTION tol (TAYLOR_MAX_BOUND without a tolerance, and at most that). A relative
    error delta per weight moves every row sum by at most delta, so the marginal error the expansion
    can hide from the solve's check is at most a quarter of ``tol``; the softmin means' weights, which
    the converged solve itself leaves ~tol off, by the same fraction."""
    return TAYLOR_MAX_BOUND if tol is None else min(TAYLOR_MAX_BOUND, TAYLOR_TOL_FRACTION * tol)


def taylor_order(t: float, tol: float | None, mean: bool = False) -> int | None:
    """The cheapest order of TAYLOR_ORDERS whose worst-case relative error per pair at t = r_k r_l /
    eps is within taylor_limit(tol), or None (the direct pass). With the softmin ``mean`` the mean's
    weights come from the series' derivative, one degree lower: taylor_bound(t, p - 1) decides."""
    for p in TAYLOR_ORDERS:
        if taylor_bound(t, p - 1 if mean else p) <= taylor_limit(tol):
            return p
    return None


def taylor_alphas(d: int, p: int) -> list[tuple[int, ...]]:
    """The multi-indices of total degree <= p in d <= 3 coordinates, graded (as 3-tuples, zeros beyond d)."""
    out = []
    for deg in range(p + 1):
        for a in _compositions(deg, d):
            out.append(tuple(a) + (0,) * (3 - d))
    return out


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    return [(first,) + rest for first in range(total, -1, -1) for rest in _compositions(total - first, parts - 1)]


def taylor_rank(d: int, p: int) -> int:
    """The padded rank R of the Taylor pass: C(p + d, d) monomials rounded up to a power of two >= 16."""
    return max(16, 1 << (math.comb(p + d, d) - 1).bit_length())


def taylor_alpha_table(d: int, p: int) -> list[list[float]]:
    """The kernels' (R, 4) table: rows [a_0, a_1, a_2, 1 / sqrt(alpha!)], then zero rows to R."""
    rows = [[float(a) for a in alpha] + [1.0 / math.sqrt(math.prod(math.factorial(a) for a in alpha))]
            for alpha in taylor_alphas(d, p)]
    return rows + [[0.0, 0.0, 0.0, 0.0]] * (taylor_rank(d, p) - len(rows))


def taylor_mean_groups(d: int) -> int:
    """Row groups of the monomials with the mean: phi and its d derivatives' psi^c, a power of two."""
    return 1 << d.bit_length()


def taylor_derivative_table(d: int, p: int) -> list[list[list[float]]]:
    """The monomials kernel's (G, R, 4) table for the softmin mean (G = taylor_mean_groups(d)):
    group 0 is :func:`taylor_alpha_table` (phi); group c + 1 (c < d) gives
    psi^c_alpha(u) = sqrt(alpha_c) phi_(alpha - e_c)(u) = sqrt(eps) d phi_alpha / du_c, as rows
    [alpha - e_c, sqrt(alpha_c) / sqrt((alpha - e_c)!)] (zero rows where alpha_c = 0), so that
    v_c exp(<u, v> / eps) = sqrt(eps) sum_alpha psi^c_alpha(u) phi_alpha(v) up to the order's
    remainder (the derivative of the truncated series); groups c >= d and padding rows are zero."""
    rank = taylor_rank(d, p)
    groups = [taylor_alpha_table(d, p)]
    for c in range(taylor_mean_groups(d) - 1):
        rows = []
        for alpha in taylor_alphas(d, p) if c < d else []:
            if alpha[c] == 0:
                rows.append([0.0, 0.0, 0.0, 0.0])
                continue
            low = tuple(a - (j == c) for j, a in enumerate(alpha))
            rows.append([float(a) for a in low]
                        + [math.sqrt(alpha[c]) / math.sqrt(math.prod(math.factorial(a) for a in low))])
        groups.append(rows + [[0.0, 0.0, 0.0, 0.0]] * (rank - len(rows)))
    return groups


def taylor_worthwhile(points_per_row_cluster: float, points_per_col_cluster: float, mean: bool = False) -> bool:
    """Whether the Taylor pass beats the direct one on these cluster sizes (TAYLOR_MIN_POINTS; with
    the softmin mean, TAYLOR_MEAN_MIN_POINTS)."""
    least = TAYLOR_MEAN_MIN_POINTS if mean else TAYLOR_MIN_POINTS
    return min(points_per_row_cluster, points_per_col_cluster) >= least


def lift_truncated_worthwhile(points: int, clusters: int) -> bool:
    """Whether the truncated lift beats the dense one: at least LIFT_TRUNCATED_MIN_POINTS points per
    cluster over both clouds (``points`` n + m, ``clusters`` K_x + K_y)."""
    return points >= LIFT_TRUNCATED_MIN_POINTS * max(clusters, 1)


# ----------------------------------------------------------------------------- relaxed marginals


def check_relaxation(rho_x: float | None, rho_y: float | None) -> bool:
    """Whether the multiscale solve is relaxed; a one-sided or unequal relaxation of the debiased
    GeomLoss loss raises (its self problems split, core/unbalanced.self_problems_split)."""
    if rho_x != rho_y:
        raise NotImplementedError(f"backend='multiscale' relaxes both marginals equally (reach=...); got "
                                  f"rho_x={rho_x}, rho_y={rho_y} (reach_x / reach_y): use backend='online'")
    return rho_x is not None


def relaxed_rows(eps_list: list[float], s: float, rho_x: float | None, rho_y: float | None) -> list[list[float]]:
    """The PARAMS rows of a schedule: [eps, s, 0, 0] when strict, else [eps, s, tau_x, 1/rho_x,
    tau_y, 1/rho_y, 0, 0] with tau = rho / (rho + eps) at each eps (1, 0 on a strict side);
    32 bytes, every row aligned."""
    if rho_x is None and rho_y is None:
        return [[e, s, 0.0, 0.0] for e in eps_list]
    side = lambda e, r: [1.0, 0.0] if r is None else [r / (r + e), 1.0 / r]  # noqa: E731
    return [[e, s] + side(e, rho_x) + side(e, rho_y) + [0.0, 0.0] for e in eps_list]


def relax_indices(rho_x: float | None, rho_y: float | None) -> tuple[int, int]:
    """The kernels' RELAX_AT of the updates of x's potentials (f_ba, f_aa) and of y's (g_ab, g_bb)."""
    return (0 if rho_x is None else 2), (0 if rho_y is None else 4)


def bound_potential(xp, pot, eps: float, rho_: float | None):
    """h = max(pot, pot / tau), tau = rho / (rho + eps): the potential the truncation test and the
    dropped-mass bound fit on a relaxed side (module docstring); ``pot`` itself when strict."""
    if rho_ is None:
        return pot
    return xp.maximum(pot, pot * (1.0 + eps / rho_))


def ott_relaxed_weights(xp, w, tau: float):
    """OTT's relaxed problem as a damped GeomLoss one: with F = f - tau eps log a, OTT's update
    f = tau (eps log a - eps LSE_j((g_j - C_ij) / eps)) is F = -tau eps LSE_j(log b'_j + (G_j - C_ij)
    / eps) on the weights a' = a^tau (b' = b^tau likewise), its plan exp((f_i + g_j - C_ij) / eps)
    = a'_i b'_j exp((F_i + G_j - C_ij) / eps) and its marginal target a exp(-f / rho) = a' exp(-F / rho)."""
    return w if tau == 1.0 else xp.where(w > 0, w, 0.0) ** tau
