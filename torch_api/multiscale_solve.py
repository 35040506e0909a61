"""GeomLoss's multiscale annealed Sinkhorn on the block-sparse kernels (torch; d <= 3).

The rules (clusters, jump, truncation) are ``ot_triton_jax.core.multiscale_rules``'s. The solve
follows GeomLoss's ``sinkhorn_loop`` with ``backend="multiscale"`` (p = 2, C = |x - y|^2 / 2):

1. schedule eps_0 = diameter^2 > ... > blur^2; at eps_0 every potential starts from a softmin of 0;
2. for k = 0 .. jump, symmetric averaged updates on the clusters (weights: summed, points:
   centroids);
3. at k = jump: the truncation mask from the coarse potentials (f_k + g_l > C_kl - truncate eps),
   then the coarse-to-fine extrapolation (f_i = softmin over the y clusters with their coarse
   g, for every fine point i, and likewise g, f_aa, g_bb); the self terms are truncated with
   their own masks;
4. for k = jump + 1 .. L - 1, averaged updates on the points, streaming only the kept blocks;
5. the last extrapolation at blur^2 (a full update).

When the grid never gets coarser than the blur (jump = L - 1) every step runs on the clusters
and the fine potentials are only extrapolated at the end, with every block kept (GeomLoss
truncates only before fine iterations). Potentials come back in the points' original order.

Gradients: :func:`direction` is GeomLoss's rule (autograd through the last extrapolation only)
on the kept blocks. The ``SamplesLoss`` backend, the HVP and the JAX twin are not wired to it yet
(bench/NOTES.md, issue 15).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ot_triton_jax.core import launch_plans, multiscale_rules as rules, runtime
from ot_triton_jax.core.schedules import epsilon_schedule

from .kernel_ops import Cloud, apply_plan_blocksparse, clouds, lse_blocksparse, lse_update, params
from .multiscale_clusters import Clusters, cluster_pair, dropped_mass_bound, keep_clusters, row_block_mask
from .sinkhorn_loops import masked_log

S = 0.5  # C = |x - y|^2 / 2


@dataclass
class MultiscaleResult:
    """Potentials in the points' original order: ``new`` = (f_ba, g_ab, f_aa, g_bb) after the last
    extrapolation, ``old`` = the ones entering it (f_aa, g_bb are None without debias); ``eps``
    the schedule, ``jump`` its last coarse index, ``kept`` the fraction of cluster pairs of the
    (x, y) problem streamed at the fine scale, ``clusters`` (K_x, K_y), ``dropped_mass_bound`` an
    upper bound on the final (x, y) plan's mass in the blocks the fine solve skipped
    (``multiscale_clusters.dropped_mass_bound``; 0 when nothing was skipped). Truncation is exact
    to float32 when that bound is below 2^-24 times the total mass. The bound is rigorous but can be
    vacuous: 64-row blocks spanning several voxels have large radii, and the raw potentials' maxima
    enter the exponent (H100, 2^16 randn points, blur 0.05: 1.8e301)."""

    new: tuple
    old: tuple
    eps: list
    jump: int
    kept: float
    clusters: tuple
    dropped_mass_bound: float = 0.0
    state: tuple = ()  # (X, Y, la, lb, masks, cx, cy, sorted new, sorted old, last eps): for direction()


def _masks(keep: Tensor, cx: Clusters, cy: Clusters, block_m: int) -> tuple:
    """(row-block mask of x over y's clusters, its y-over-x twin) for one kept cluster-pair set."""
    return (row_block_mask(keep, cx.label, block_m), row_block_mask(keep.t().contiguous(), cy.label, block_m))


def anneal(x: Tensor, y: Tensor, a: Tensor, b: Tensor, blur: float, scaling: float, diameter: float,
           cluster_scale: float | None = None, truncate: float | None = rules.DEFAULT_TRUNCATE,
           debias: bool = True, precision: str = "float32") -> MultiscaleResult:
    """The multiscale annealed solve of one problem (x (n, d), y (m, d), d <= 3; weights a, b
    of equal mass); see the module docstring."""
    rules.check_dim(x.shape[1])
    truncate = rules.truncate_value(truncate)
    scale = rules.cluster_scale_value(cluster_scale, diameter, x.shape[1])
    eps_list = epsilon_schedule(2, diameter, blur, scaling)
    jump = rules.jump_index(eps_list, scale)
    cx, cy = cluster_pair(x, a, y, b, scale)
    dev = x.device
    xs, ys = x.detach()[cx.perm], y.detach()[cy.perm]
    la, lb = masked_log(a.detach()[cx.perm].float()), masked_log(b.detach()[cy.perm].float())
    lac, lbc = masked_log(cx.weight.float()), masked_log(cy.weight.float())
    X, Y, Xc, Yc = clouds(xs, ys, cx.centroid, cy.centroid)
    block_m = launch_plans.blocksparse_block_m(x.shape[1], precision, runtime.on_gpu())

    def dense(src: Cloud, tgt: Cloud, pot, logw, prm):
        return lse_update(src, tgt, pot, prm, precision, logw_in=logw)[0]

    def sweep(pair, pots, prm):
        (P, Q, lp, lq, sparse) = pair
        f_ba, g_ab, f_aa, g_bb = pots
        if sparse is None:
            out = [dense(P, Q, g_ab, lq, prm), dense(Q, P, f_ba, lp, prm), None, None]
            if debias:
                out[2], out[3] = dense(P, P, f_aa, lp, prm), dense(Q, Q, g_bb, lq, prm)
            return tuple(out)
        (mxy, myx, mxx, myy) = sparse
        out = [lse_blocksparse(P, Q, g_ab, prm, mxy, cy.start, precision, logw_in=lq)[0],
               lse_blocksparse(Q, P, f_ba, prm, myx, cx.start, precision, logw_in=lp)[0], None, None]
        if debias:
            out[2] = lse_blocksparse(P, P, f_aa, prm, mxx, cx.start, precision, logw_in=lp)[0]
            out[3] = lse_blocksparse(Q, Q, g_bb, prm, myy, cy.start, precision, logw_in=lq)[0]
        return tuple(out)

    prms = [params(e, S, dev) for e in eps_list]
    coarse = (Xc, Yc, lac, lbc, None)
    zx, zy = torch.zeros(cx.k, device=dev), torch.zeros(cy.k, device=dev)
    pots = sweep(coarse, (zx, zy, zx, zy), prms[0])
    pair, kept = coarse, 1.0
    for k, eps in enumerate(eps_list):
        new = sweep(pair, pots, prms[k])
        pots = tuple(None if p is None else 0.5 * (p + q) for p, q in zip(pots, new))
        if k == jump:
            f_ba, g_ab, f_aa, g_bb = pots
            t = truncate if k < len(eps_list) - 1 else None
            keep_xy = keep_clusters(f_ba, g_ab, cx, cy, eps, t)
            kept = float(keep_xy.float().mean())
            masks = _masks(keep_xy, cx, cy, block_m)
            if debias:
                masks += (row_block_mask(keep_clusters(f_aa, f_aa, cx, cx, eps, t), cx.label, block_m),
                          row_block_mask(keep_clusters(g_bb, g_bb, cy, cy, eps, t), cy.label, block_m))
            else:
                masks += (None, None)
            pots = (dense(X, Yc, g_ab, lbc, prms[k]), dense(Y, Xc, f_ba, lac, prms[k]),
                    dense(X, Xc, f_aa, lac, prms[k]) if debias else None,
                    dense(Y, Yc, g_bb, lbc, prms[k]) if debias else None)
            pair = (X, Y, la, lb, masks)
    final = sweep(pair, pots, prms[-1])
    bound = 0.0
    if pair[4] is not None and not bool(pair[4][0].all()):
        bound = dropped_mass_bound(pair[4][0], xs, a.detach()[cx.perm], final[0], cy, ys, b.detach()[cy.perm],
                                   final[1], eps_list[-1], block_m)
    inv_x, inv_y = torch.argsort(cx.perm), torch.argsort(cy.perm)
    unsort = (inv_x, inv_y, inv_x, inv_y)
    back = lambda ps: tuple(None if p is None else p[i] for p, i in zip(ps, unsort))  # noqa: E731
    return MultiscaleResult(new=back(final), old=back(pots), eps=eps_list, jump=jump, kept=kept,
                            clusters=(cx.k, cy.k), dropped_mass_bound=bound,
                            state=(X, Y, la, lb, pair[4], cx, cy, final, pots, prms[-1]))


def direction(res: MultiscaleResult, side: int, debias: bool = True, precision: str = "float32") -> Tensor:
    """dF_i/dx_i (side 0) or dG_j/dy_j (side 1), in the points' original order: the derivative of
    the last extrapolation (F = f_ba - f_aa; the other potentials held fixed, as GeomLoss's
    detached second arguments), on the blocks the fine solve kept:
    Q x / Q 1 - P y / P 1 (debias) or x - P y / P 1, P and Q the last extrapolation's softmin
    weights over the kept columns. The loss gradient is a_i dF_i/dx_i (b_j dG_j/dy_j)."""
    X, Y, la, lb, masks, cx, cy, new, old, prm = res.state
    if masks is None:
        raise ValueError("direction: this result never reached the points (no fine stage)")
    eps = prm[0]
    if side == 0:
        S_, T, f_st, g_st, lw_s, lw_t, m_st, m_ss, c_t, c_s, perm = (X, Y, new[0], old[1], la, lb, masks[0],
                                                                     masks[2], cy.start, cx.start, cx.perm)
        f_ss, old_ss = new[2], old[2]
    else:
        S_, T, f_st, g_st, lw_s, lw_t, m_st, m_ss, c_t, c_s, perm = (Y, X, new[1], old[0], lb, la, masks[1],
                                                                     masks[3], cx.start, cy.start, cy.perm)
        f_ss, old_ss = new[3], old[3]
    p_t, r = apply_plan_blocksparse(S_, T, f_st, g_st + eps * lw_t, prm, m_st, c_t, precision, T.x)
    rows = S_.x - p_t / r[:, None]
    if debias:
        q_s, q = apply_plan_blocksparse(S_, S_, f_ss, old_ss + eps * lw_s, prm, m_ss, c_s, precision, S_.x)
        rows = q_s / q[:, None] - p_t / r[:, None]
    return rows[torch.argsort(perm)]
