"""GeomLoss's multiscale annealed Sinkhorn on the block-sparse kernels (torch; d <= 3).

The rules (clusters, jump, truncation bound, finishing) are ``ot_triton_jax.core.multiscale_rules``'s.
The solve follows GeomLoss's ``sinkhorn_loop`` with ``backend="multiscale"`` (p = 2,
C = |x - y|^2 / 2):

1. schedule eps_0 = diameter^2 > ... > blur^2; at eps_0 every potential starts from a softmin of 0;
2. for k = 0 .. jump, symmetric averaged updates on the clusters (weights: summed, points:
   centroids);
3. at k = jump, the coarse-to-fine extrapolation (f_i = softmin over the y clusters with their
   coarse g, for every fine point i, and likewise g, f_aa, g_bb). With ``tol`` and truncation (the
   jump is then at blur^2) and at least multiscale_rules.LIFT_TRUNCATED_MIN_POINTS points per
   cluster (``LIFT``), only over the first fine sweep's kept cluster pairs: those masks come first,
   from upper bounds of the lifted potentials at the centroids (bounds.lifted_fit; lift.py), and
   the dropped-mass bound of that sweep from the same fits raised to cover the potentials (cover);
4. for k = jump + 1 .. L - 1, averaged updates on the points, each streaming only the blocks
   that the truncation bound keeps for the current potentials (masks refreshed at every sweep);
5. with ``tol``: finishing steps at blur^2 until the four truncated plans' marginal errors are
   at most ``tol`` (the check is free: the kernels' COMPUTE_ERR epilogue): GeomLoss's averaged
   updates converge slowly at the final eps, so (f_ba, g_ab) take over-relaxed alternating
   updates (f <- (1 - w) f + w softmin(g), then g likewise from the new f, w = FINISH_OMEGA),
   the self terms averaged ones; from the second step on (on the clusters and on the points), (f_ba, g_ab) take Anderson-accelerated
   alternating steps instead (anderson.py; restarted with an over-relaxed step when the
   error jumps above ANDERSON_RESTART times its best);
6. the last extrapolation at blur^2: the sweep whose check passed (without ``tol``: one more
   sweep, as GeomLoss), not averaged.

Potentials come back in the points' original order. Gradients: gradient.direction is GeomLoss's
rule (autograd through the last extrapolation only) on the kept blocks. The phases live beside
this loop: problem.py (the sorted clouds, masks and ranges), coarse.py (the sweeps on the
clusters), lift.py (the coarse-to-fine extrapolation), fine.py (the sweeps on the points),
prewarm.py (the kernels a solve launches, compiled before its first launch).
"""


from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ot_triton_jax.core import multiscale_plans, multiscale_rules as rules, runtime
from ot_triton_jax.core.schedules import epsilon_schedule

from ..host_copy import to_device
from ..kernel_ops import clouds, lse_blocksparse, lse_update
from ..sinkhorn_loops import masked_log
from . import bounds as mb
from .anderson import AndersonMixer
from .clusters import cluster_pair, occupied_cells
from .coarse import CoarsePhase
from .fine import fine_sweep
from .lift import dense_lift, lift_truncated, lifted_fits, truncated_lift
from .prewarm import prewarm, start_first_call, taylor_orders
from .problem import Problem, kept_fraction

S = 0.5  # C = |x - y|^2 / 2




@dataclass
class MultiscaleResult:
    """Potentials in the points' original order: ``new`` = (f_ba, g_ab, f_aa, g_bb) after the last
    extrapolation, ``old`` = the ones entering it (f_aa, g_bb are None without debias); ``eps``
    the schedule, ``jump`` its last coarse index, ``clusters`` (K_x, K_y), ``kept`` the fraction
    of cluster pairs of the (x, y) problem the last extrapolation streamed, ``sweeps`` the sweeps
    on the points (schedule, finishing and the last extrapolation), ``finish_sweeps`` the
    finishing sweeps alone, ``taylor_passes`` the plan updates the Taylor pass made (taylor.py),
    ``marginal_error`` the largest ||P 1 - a||_1 (relaxed: ||P 1 - a exp(-f / rho)||_1) of the four truncated
    plans entering the last extrapolation (None without ``tol``), ``converged`` whether it met
    ``tol``, ``dropped_mass_bound`` the summed upper bound on the last extrapolation's four plans'
    mass in the skipped blocks (0 when nothing was skipped): the loss is within
    eps * dropped_mass_bound of the untruncated last extrapolation (multiscale_rules; relaxed: each
    potential within tau eps * dropped_mass_bound in the weighted L1 sum, same rules). When the
    jump is at the last eps and ``tol`` is None, the last extrapolation is GeomLoss's, from the
    clusters: ``old`` then holds the cluster potentials and nothing was truncated."""

    new: tuple
    old: tuple
    eps: list
    jump: int
    kept: float
    clusters: tuple
    sweeps: int = 0
    finish_sweeps: int = 0
    coarse_finish_sweeps: int = 0
    taylor_passes: int = 0
    marginal_error: float | None = None
    converged: bool = True
    dropped_mass_bound: float = 0.0
    state: tuple = field(default=(), repr=False)  # for gradient.direction and hvp.multiscale_hvp: clouds, ranges, masks, ...


def anneal(x: Tensor, y: Tensor, a: Tensor, b: Tensor, blur: float, scaling: float, diameter: float,
           cluster_scale: float | None = None, truncate: float | None = rules.DEFAULT_TRUNCATE,
           debias: bool = True, precision: str = "float32", tol: float | None = rules.DEFAULT_TOL,
           trace: list | None = None, means: tuple = (True, True),
           rho: tuple = (None, None)) -> MultiscaleResult:
    """The multiscale annealed solve of one problem (x (n, d), y (m, d), d <= 3; weights a, b
    of equal mass); see the module docstring. ``trace``: a list that receives (eps, ranges, kind)
    of every sweep on the points, kind "average", "finish" (over-relaxed), "anderson" or "final", and of
    every coarse finishing step (ranges None), kind "coarse_finish" or "coarse_anderson"; finishing
    steps carry a 4th element, the Anderson mixing coefficients (None: none) (tests). ``means``: (x side,
    y side), whether the gradient of that side will be asked for: the sweeps that may be the last
    extrapolation then stream that side's plans once for both the update and the gradient's
    softmin means (fine.update_and_mean), and gradient.direction needs no further pass. ``rho``:
    (rho_x, rho_y), KL-relaxed marginals (None: strict; a and b may then differ in mass): every
    update of a side damped by rho / (rho + eps_k), the errors against a exp(-f / rho), the masks
    and the dropped-mass bound from the bound potentials (multiscale_rules: relaxed marginals)."""
    rules.check_dim(x.shape[1])
    start_first_call()
    truncate, tol = rules.truncate_value(truncate), rules.tol_value(tol)
    scale = rules.cluster_scale_value(cluster_scale, diameter, x.shape[1], None if tol is None else blur)
    if cluster_scale is None and tol is not None:
        scale = rules.finer_cluster_scale(scale, blur, lambda side: occupied_cells(x, y, side))
    eps_list = epsilon_schedule(2, diameter, blur, scaling)
    jump = rules.jump_index(eps_list, scale)
    cx, cy = cluster_pair(x, a, y, b, scale)
    dev = x.device
    per_cluster = (x.shape[0] / max(cx.k, 1), y.shape[0] / max(cy.k, 1))
    xs, ys = x.detach()[cx.perm], y.detach()[cy.perm]
    if runtime.on_gpu():  # the prewarm's key: the Taylor orders the solve will take (a host read)
        orders = taylor_orders(xs, ys, cx, cy, per_cluster, eps_list[jump + 1:] or eps_list[-1:], tol, debias, means,
                               truncate is not None)
        prewarm((x.shape[0], y.shape[0], cx.k, cy.k, x.shape[1], precision, debias, tol is not None, tuple(means),
                 truncate is not None, orders), dev)
    a_s, b_s = a.detach()[cx.perm].float(), b.detach()[cy.perm].float()
    la, lb = masked_log(a_s), masked_log(b_s)
    lac, lbc = masked_log(cx.weight.float()), masked_log(cy.weight.float())
    X, Y, Xc, Yc = clouds(xs, ys, cx.centroid, cy.centroid)
    gx, gy = mb.geometry(xs, a_s, cx), mb.geometry(ys, b_s, cy)
    pb = Problem(X, Y, Xc, Yc, cx, cy, gx, gy, a_s, b_s, la, lb, lac, lbc, precision, debias, truncate, tol,
                 tuple(means), per_cluster, multiscale_plans.blocksparse_block_m(x.shape[1], precision, runtime.on_gpu()),
                 rho=tuple(rho))
    # PARAMS [eps, S] of every eps, one row each, padded to 16 bytes (every row aligned as a lone PARAMS
    # array is: Triton specializes pointers on it), in one non-blocking copy
    # (relaxed: [eps, S, tau_x, 1/rho_x, tau_y, 1/rho_y, 0, 0], multiscale_rules.relaxed_rows)
    prm_rows = to_device(torch.tensor(rules.relaxed_rows(eps_list, S, *rho), dtype=torch.float32), dev)
    relax = rules.relax_indices(*rho)
    prms = list(prm_rows)
    coarse_finish = 0
    if tol is not None:  # the whole schedule on the clusters, converged there, then lifted at blur^2
        jump = len(eps_list) - 1
    coarse = CoarsePhase(Xc, Yc, lac, lbc, cx.weight.float(), cy.weight.float(), prm_rows, precision, debias,
                         (jump, tol is not None), relax)
    pots = coarse.anneal(jump)
    if tol is not None:
        mixer, best = AndersonMixer(rules.ANDERSON_DEPTH), float("inf")
        while coarse_finish < rules.MAX_COARSE_SWEEPS:
            swept, err = coarse.check(pots)
            if err <= rules.COARSE_TOL_FRACTION * tol:
                break
            pots, kind, gamma = _finishing_step(mixer, coarse_finish == 0, best, err, pots, swept,
                                                lambda f: lse_update(Yc, Xc, f, prms[-1], precision, logw_in=lac,
                                                                   relax_at=relax[1])[0])
            best = min(best, err)
            if trace is not None:
                trace.append((eps_list[-1], None, "coarse_" + kind, None if gamma is None else gamma.cpu()))
            coarse_finish += 1
    f_ba, g_ab, f_aa, g_bb = pots  # coarse-to-fine extrapolation at eps_jump
    first_keep = first_fits = None
    if truncated_lift(truncate is not None, tol is not None, x.shape[0] + y.shape[0], cx.k + cy.k, pb.relaxed):
        # at blur^2, where the first fine sweep runs too: its masks from bounds on the lifted
        # potentials (no lifted potential needed), and the lift over those masks' pairs only
        first_fits = lifted_fits(pb, pots, prms[-1], eps_list[-1])
        first_keep = pb.keeps(first_fits, eps_list[-1])
        pots = lift_truncated(pb, pots, first_keep, first_fits, prms[-1])
    else:
        pots = dense_lift(pb, pots, prms[jump])

    inv_x, inv_y = torch.argsort(cx.perm), torch.argsort(cy.perm)
    unsort = (inv_x, inv_y, inv_x, inv_y)
    back = lambda ps: tuple(None if p is None else p[i] for p, i in zip(ps, unsort))  # noqa: E731
    if jump == len(eps_list) - 1 and tol is None:
        # GeomLoss: a jump at the last eps is the last extrapolation (from the clusters, nothing truncated)
        plans = {"xy": (X, Yc, g_ab, lbc, None), "yx": (Y, Xc, f_ba, lac, None),
                 "xx": (X, Xc, f_aa, lac, None), "yy": (Y, Yc, g_bb, lbc, None)}
        extra = {"keep": None, "labels": (cx.label, cy.label), "weights": (a_s, b_s), "means": (None,) * 4}
        return MultiscaleResult(new=back(pots), old=(f_ba, g_ab, f_aa, g_bb), eps=eps_list, jump=jump, kept=1.0,
                                clusters=(cx.k, cy.k), state=(pots, plans, prms[-1], (cx.perm, cy.perm), extra))

    sweeps, finish, err = 0, 0, None
    for k in range(jump + 1, len(eps_list)):
        keep = pb.masks(pots, eps_list[k])[0]
        rng = pb.ranges_of(keep)
        if trace is not None:
            trace.append((eps_list[k], rng.all(), "average"))
        pots = _average(pots, fine_sweep(pb, rng, keep, pots, prms[k], eps_list[k], False)[0])
        sweeps += 1
    mixer, best = AndersonMixer(rules.ANDERSON_DEPTH), float("inf")
    while True:  # finishing sweeps; the one whose check passes is the last extrapolation
        covered = first_keep is not None
        if covered:  # the lift's masks; for the dropped-mass bound, their fits raised to cover the lifted potentials
            keep, fits_old, first_keep = first_keep, pb.covers(first_fits, pots), None
        else:
            keep, fits_old = pb.masks(pots, eps_list[-1])
        rng = pb.ranges_of(keep)
        final, errs, mean = fine_sweep(pb, rng, keep, pots, prms[-1], eps_list[-1], tol is not None, last=True)
        sweeps += 1
        err = errs  # a float with tol (fine_sweep's one host read), else None
        if tol is None or err <= tol or finish >= rules.MAX_FINISH_SWEEPS:
            if trace is not None:
                trace.append((eps_list[-1], rng.all(), "final"))
            break
        g_from = lambda f, rng=rng, pold=pots[1]: lse_blocksparse(Y, X, f, prms[-1], rng[1], precision,  # noqa: E731
                                                                  logw_in=la, pold=pold, compute_err=False, fold=True,
                                                                  relax_at=relax[1])[0]
        pots, kind, gamma = _finishing_step(mixer, finish == 0, best, err, pots, final, g_from)
        best = min(best, err)
        if trace is not None:
            trace.append((eps_list[-1], rng.all(), kind, None if gamma is None else gamma.cpu()))
        finish += 1
    converged = tol is None or err <= tol
    if not converged:
        warnings.warn(f"backend='multiscale': the marginal error {err:.3g} is above tol={tol:g} after "
                      f"{finish} finishing sweeps at blur^2; the result is the last sweep's. Raise tol or blur (Sinkhorn "
                      f"converges slowly on long-tailed clouds at a small blur; truncation is not the cause)",
                      RuntimeWarning, stacklevel=2)

    eps = eps_list[-1]
    bound = torch.zeros((), dtype=torch.float64, device=dev)
    if truncate is not None:
        fits_new = pb.covers(fits_old, final) if covered else pb.fits_of(final, eps)
        bound = (mb.dropped_mass(gx, fits_new[0], gy, fits_old[1], eps, keep[0])
                 + mb.dropped_mass(gy, fits_new[1], gx, fits_old[0], eps, keep[1]))
        if debias:
            bound += (mb.dropped_mass(gx, fits_new[2], gx, fits_old[2], eps, keep[2])
                      + mb.dropped_mass(gy, fits_new[3], gy, fits_old[3], eps, keep[3]))
    # the ranges gradient.direction may use: the means' plans whose mean is missing
    rng.build([k for k in range(len(keep)) if mean[k] is None and keep[k] is not None and means[(0, 1, 0, 1)[k]]])
    bound, kept = torch.stack([bound.double(), kept_fraction(keep[0])]).tolist()  # one host read
    rng.release()
    # the HVP's plans (hvp.py): the last sweep's cluster masks (xy, xx, yy; None: nothing truncated)
    extra = {"keep": (keep[0], keep[2], keep[3]) if truncate is not None else None, "labels": (cx.label, cy.label), "weights": (a_s, b_s),
             "means": tuple(mean)}
    plans = {"xy": (X, Y, pots[1], lb, rng.getter(0)), "yx": (Y, X, pots[0], la, rng.getter(1)),
             "xx": (X, X, pots[2], la, rng.getter(2)), "yy": (Y, Y, pots[3], lb, rng.getter(3))}
    return MultiscaleResult(new=back(final), old=back(pots), eps=eps_list, jump=jump,
                            kept=kept, clusters=(cx.k, cy.k), sweeps=sweeps,
                            finish_sweeps=finish, coarse_finish_sweeps=coarse_finish, marginal_error=err,
                            taylor_passes=pb.taylor_passes,
                            converged=converged,
                            dropped_mass_bound=bound,
                            state=(final, plans, prms[-1], (cx.perm, cy.perm), extra))


def _average(ps, qs) -> tuple:
    return tuple(None if p is None else 0.5 * (p + q) for p, q in zip(ps, qs))


def _relax(pots, swept, g_from) -> tuple:
    """Over-relaxed alternating update of (f_ba, g_ab) (the sweep's f_ba, then g_ab = g_from(new
    f_ba)), averaged updates of the self terms (already fast: their plans are symmetric)."""
    w = rules.FINISH_OMEGA
    f_ba = (1.0 - w) * pots[0] + w * swept[0]
    g_ab = (1.0 - w) * pots[1] + w * g_from(f_ba)
    return (f_ba, g_ab) + _average(pots[2:], swept[2:])


def _finishing_step(mixer, first, best, err, pots, swept, g_from) -> tuple:
    """(next potentials, kind, gamma): the first step (g is not yet softmin(f)) and any step whose
    error jumped above ANDERSON_RESTART times the best: over-relaxed, with a fresh history;
    otherwise Anderson on T(f) = softmin(softmin(f)) for (f_ba, g_ab) (anderson.py),
    g_ab = softmin(f_ba); the self terms averaged."""
    if first or err > rules.ANDERSON_RESTART * best:
        mixer.reset()
        return _relax(pots, swept, g_from), "finish", None
    f_next, gamma = mixer.step(pots[0], swept[0])
    return (f_next, g_from(f_next)) + _average(pots[2:], swept[2:]), "anderson", gamma
