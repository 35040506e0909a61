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
   from upper bounds of the lifted potentials at the centroids (multiscale_bounds.lifted_fit), and
   the dropped-mass bound of that sweep from the same fits raised to cover the potentials (cover);
4. for k = jump + 1 .. L - 1, averaged updates on the points, each streaming only the blocks
   that the truncation bound keeps for the current potentials (masks refreshed at every sweep);
5. with ``tol``: finishing steps at blur^2 until the four truncated plans' marginal errors are
   at most ``tol`` (the check is free: the kernels' COMPUTE_ERR epilogue): GeomLoss's averaged
   updates converge slowly at the final eps, so (f_ba, g_ab) take over-relaxed alternating
   updates (f <- (1 - w) f + w softmin(g), then g likewise from the new f, w = FINISH_OMEGA),
   the self terms averaged ones; from the second step on (on the clusters and on the points), (f_ba, g_ab) take Anderson-accelerated
   alternating steps instead (multiscale_anderson; restarted with an over-relaxed step when the
   error jumps above ANDERSON_RESTART times its best);
6. the last extrapolation at blur^2: the sweep whose check passed (without ``tol``: one more
   sweep, as GeomLoss), not averaged.

Potentials come back in the points' original order. Gradients: :func:`direction` is GeomLoss's
rule (autograd through the last extrapolation only) on the kept blocks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ot_triton_jax.core import kernel_calls as kc, launch_plans, multiscale_calls as mc, multiscale_plans, multiscale_rules as rules, runtime
from ot_triton_jax.core.schedules import epsilon_schedule

from . import cuda_graphs, multiscale_bounds as mb, multiscale_taylor as taylor
from .host_copy import to_device
from .multiscale_anderson import AndersonMixer
from .kernel_ops import (Cloud, apply_plan, apply_plan_blocksparse, clouds, lift_gathered, lse_blocksparse, lse_update,
                         prewarm)
from .launch import spawn_compile_workers
from .multiscale_clusters import cluster_pair, kept_lists_many, kept_ranges, kept_ranges_many, occupied_cells
from .sinkhorn_loops import masked_log

S = 0.5  # C = |x - y|^2 / 2
# the coarse-to-fine lift over the first sweep's masks (anneal): "auto" where
# multiscale_rules.lift_truncated_worthwhile, "always" (tests), "never" (the dense lift; A/B benchmarks)
LIFT = "auto"


@dataclass
class MultiscaleResult:
    """Potentials in the points' original order: ``new`` = (f_ba, g_ab, f_aa, g_bb) after the last
    extrapolation, ``old`` = the ones entering it (f_aa, g_bb are None without debias); ``eps``
    the schedule, ``jump`` its last coarse index, ``clusters`` (K_x, K_y), ``kept`` the fraction
    of cluster pairs of the (x, y) problem the last extrapolation streamed, ``sweeps`` the sweeps
    on the points (schedule, finishing and the last extrapolation), ``finish_sweeps`` the
    finishing sweeps alone, ``taylor_passes`` the plan updates the Taylor pass made (multiscale_taylor),
    ``marginal_error`` the largest ||P 1 - a||_1 of the four truncated
    plans entering the last extrapolation (None without ``tol``), ``converged`` whether it met
    ``tol``, ``dropped_mass_bound`` the summed upper bound on the last extrapolation's four plans'
    mass in the skipped blocks (0 when nothing was skipped): the loss is within
    eps * dropped_mass_bound of the untruncated last extrapolation (multiscale_rules). When the
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
    state: tuple = field(default=(), repr=False)  # for direction() and multiscale_hvp: clouds, ranges, masks, ...


def anneal(x: Tensor, y: Tensor, a: Tensor, b: Tensor, blur: float, scaling: float, diameter: float,
           cluster_scale: float | None = None, truncate: float | None = rules.DEFAULT_TRUNCATE,
           debias: bool = True, precision: str = "float32", tol: float | None = rules.DEFAULT_TOL,
           trace: list | None = None, means: tuple = (True, True)) -> MultiscaleResult:
    """The multiscale annealed solve of one problem (x (n, d), y (m, d), d <= 3; weights a, b
    of equal mass); see the module docstring. ``trace``: a list that receives (eps, ranges, kind)
    of every sweep on the points, kind "average", "finish" (over-relaxed), "anderson" or "final", and of
every coarse finishing step (ranges None), kind "coarse_finish" or "coarse_anderson"; finishing
steps carry a 4th element, the Anderson mixing coefficients (None: none) (tests). ``means``: (x side,
    y side), whether the gradient of that side will be asked for: the sweeps that may be the last
    extrapolation then stream that side's plans once for both the update and the gradient's
    softmin means (:func:`_update_and_mean`), and :func:`direction` needs no further pass."""
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
        orders = _taylor_orders(xs, ys, cx, cy, per_cluster, eps_list[jump + 1:] or eps_list[-1:], tol, debias, means,
                                truncate is not None)
        _prewarm((x.shape[0], y.shape[0], cx.k, cy.k, x.shape[1], precision, debias, tol is not None, tuple(means),
                  truncate is not None, orders), dev)
    a_s, b_s = a.detach()[cx.perm].float(), b.detach()[cy.perm].float()
    la, lb = masked_log(a_s), masked_log(b_s)
    lac, lbc = masked_log(cx.weight.float()), masked_log(cy.weight.float())
    X, Y, Xc, Yc = clouds(xs, ys, cx.centroid, cy.centroid)
    gx, gy = mb.geometry(xs, a_s, cx), mb.geometry(ys, b_s, cy)
    sides = {}  # the Taylor pass's view of X and Y (multiscale_taylor), built at its first use
    taylor_passes = [0]

    def taylor_side(side):
        if not sides:  # both sides at once: their radii in one host read
            sides.update({0: taylor.TaylorSide(X.x, cx.label, cx.start), 1: taylor.TaylorSide(Y.x, cy.label, cy.start)})
            taylor.settle_radii(sides[0], sides[1])
        return sides[side]
    block_m = multiscale_plans.blocksparse_block_m(x.shape[1], precision, runtime.on_gpu())

    def dense(src, tgt, pot, logw, prm):
        return lse_update(src, tgt, pot, prm, precision, logw_in=logw)[0]

    def fits_of(pots):
        """The potentials' (f_ba, g_ab, f_aa, g_bb) fits on their clusters (multiscale_bounds.fit)."""
        return [None if p is None else mb.fit(g, p) for p, g in zip(pots, (gx, gy, gx, gy))]

    def keeps(fits, eps):
        """Cluster keep masks (xy, yx = xy's transpose, xx, yy) from the potentials' fits."""
        keep = [*mb.keep_pairs(gx, fits[0], gy, fits[1], eps, truncate, transposed=True), None, None]
        if debias:
            keep[2] = mb.keep_pairs(gx, fits[2], gx, fits[2], eps, truncate)
            keep[3] = mb.keep_pairs(gy, fits[3], gy, fits[3], eps, truncate)
        return keep

    def masks(pots, eps):
        """Cluster keep masks for the current potentials, and the fits they came from."""
        fits = fits_of(pots)
        return keeps(fits, eps), fits

    def lifted_fits(coarse, prm, eps):
        """Upper-bound fits of the four lifted potentials from the coarse ones, before the lift
        (multiscale_bounds.lifted_fit): each lift's value and softmin mean at the centroids, one
        cluster-level plan pass each (``eps``: prm's, as a number)."""
        src_of = {0: (Xc, cx, gx), 1: (Yc, cy, gy)}
        out = []
        for k, (s, t, tgt_pot, logw) in enumerate(((0, 1, coarse[1], lbc), (1, 0, coarse[0], lac),
                                                    (0, 0, coarse[2], lac), (1, 1, coarse[3], lbc))):
            if tgt_pot is None:
                out.append(None)
                continue
            (src, cl, geo), tgt = src_of[s], src_of[t][0]
            own = coarse[k]  # the source side's coarse potential: a shift that keeps P 1 near 1
            pv, r = apply_plan(src, tgt, own, tgt_pot + eps * logw, prm, precision, tgt.x)
            value = own.double() - eps * torch.log(r.double())
            to_mean = src.x.double() - pv.double() / r.double()[:, None]
            out.append(mb.lifted_fit(geo, geo.center - cl.centroid.double(), value, to_mean))
        return out

    def lift_truncated(coarse, keep, fits, prm):
        """The coarse-to-fine extrapolation over the kept pairs of ``keep`` (kernels/lift_gathered.py),
        each sum shifted by the fits' prediction (an upper bound of the untruncated lift)."""
        f_ba, g_ab, f_aa, g_bb = coarse
        lists = kept_lists_many(keep)  # one host read for the four masks' pair counts
        pred = [None if f is None else mb.predict(g, f) for f, g in zip(fits, (gx, gy, gx, gy))]
        return (lift_gathered(X, cx.start, *lists[0], Yc, g_ab, lbc, pred[0], prm),
                lift_gathered(Y, cy.start, *lists[1], Xc, f_ba, lac, pred[1], prm),
                lift_gathered(X, cx.start, *lists[2], Xc, f_aa, lac, pred[2], prm) if debias else None,
                lift_gathered(Y, cy.start, *lists[3], Yc, g_bb, lbc, pred[3], prm) if debias else None)

    def covers(fits, pots):
        return [None if p is None else mb.cover(g, f, p) for f, p, g in zip(fits, pots, (gx, gy, gx, gy))]

    def ranges_of(keep):
        """The four plans' column ranges (kernels/block_ranges.py) from their cluster masks, each
        built at its first use (the Taylor pass streams the masks' pairs instead)."""
        return _Ranges(keep, (cx.label, cy.label, cx.label, cy.label), (cy.start, cx.start, cx.start, cy.start), block_m)

    def fine_sweep(rng, keep, pots, prm, eps, check, last=False):
        """One sweep: (new potentials, the largest marginal error (a float, from the sweep's one host
        read) or None, softmin means or None).
        ``last``: this sweep may be the last extrapolation: the plans of the sides in ``means``
        give their softmin means too. Each plan takes the Taylor pass (with the mean where asked)
        where multiscale_taylor.wanted asks for it, an order meets the tolerance (multiscale_taylor.order)
        and it does not decline, else the direct one (_update_and_mean where a mean is asked, else
        lse_blocksparse)."""
        f_ba, g_ab, f_aa, g_bb = pots
        # (src, tgt, potential of tgt, log-weights of tgt, old potential of src, side, tgt side)
        plans = [(X, Y, g_ab, lb, f_ba, 0, 1), (Y, X, f_ba, la, g_ab, 1, 0)]
        if debias:
            plans += [(X, X, f_aa, la, f_aa, 0, 0), (Y, Y, g_bb, lb, g_bb, 1, 1)]
        out, mean, orders = [None] * 4, [None] * 4, {}
        fused = [last and bool(means[p[5]]) for p in plans]  # plans that give the gradient's softmin mean too
        tay_p = [taylor.order(taylor_side(p[5]), taylor_side(p[6]), eps, tol, fused[k])
                 if truncate is not None and keep[k] is not None
                 and taylor.wanted(per_cluster[p[5]], per_cluster[p[6]], fused[k]) else None for k, p in enumerate(plans)]
        use_taylor = [p is not None for p in tay_p]
        rng.build([k for k in range(len(plans)) if not use_taylor[k]])  # the direct passes' ranges, one host read

        def build_orders(ks):
            """The Taylor pair lists of plans ``ks`` with one host read for all: the x-y and y-x plans
            share theirs when both take the pass (the x-y mask's kernel writes its transpose too);
            the self masks are symmetric."""
            reqs, owners = [], []
            for k in ks:
                if k in orders or any(k in o for o in owners):
                    continue
                if k >= 2:
                    reqs.append((keep[k], keep[k], True))
                    owners.append((k,))
                else:
                    reqs.append((keep[k], keep[1 - k], use_taylor[1 - k]))
                    owners.append((k, 1 - k))
            for own, pair in zip(owners, taylor.pair_orders_many(reqs) if reqs else ()):
                orders.update({k: o for k, o in zip(own, pair) if o is not None})

        def order(k):
            if k not in orders:
                build_orders([k])
            return orders[k]
        # before any pass is launched: a host read behind a pass in flight leaves the GPU idle while
        # the host then prepares the next one (bench/NOTES.md 111)
        build_orders([k for k in range(len(plans)) if use_taylor[k]])

        def run_stage(k, stage):
            """Plan k's pass: 0 Taylor, 1 direct with the mean (_update_and_mean), 2 direct (FOLD);
            (the update, the mean or None, the range check's 0-d device flag or None)."""
            src, tgt, pot, logw, pold, side, tside = plans[k]
            if stage == 0:
                res = taylor.lse(taylor_side(side), taylor_side(tside), pot, logw, pold, prm, order(k), check,
                                 fused[k], eps=eps, deferred=True, p=tay_p[k])
                return res[:2], (res[2] if fused[k] else None), res[-1]
            if stage == 1:
                return _update_and_mean(src, tgt, pot, logw, pold, prm, rng[k], precision)
            # the old potential predicts each row's LSE: the fixed-shift (FOLD) loop, checked in the kernel
            return lse_blocksparse(src, tgt, pot, prm, rng[k], precision, logw_in=logw, pold=pold,
                                   compute_err=check, fold=True), None, None
        # every plan's pass is launched before any host read: the Taylor and fused passes' range checks
        # are read once, with the marginal error; a pass that fails its check is redone by the next
        # kind (Taylor -> fused where a mean is asked, else plain; fused -> plain), then read again (rare)
        stage = [0 if use_taylor[k] else (1 if fused[k] else 2) for k in range(len(plans))]
        ok = [None] * len(plans)
        for k in range(len(plans)):
            out[k], mean[k], ok[k] = run_stage(k, stage[k])
        w = (a_s, b_s, a_s, b_s)
        while True:  # ||P 1 - a||_1 = sum_i a_i err_i (the passes' ERR with POLD, no logw_out)
            pending = [k for k in range(len(plans)) if ok[k] is not None]
            errs = torch.stack([(wi * o[1]).sum() for wi, o in zip(w, out) if o is not None]).max() if check else None
            parts = [ok[k].reshape(1).double() for k in pending] + ([errs.reshape(1).double()] if check else [])
            vals = torch.cat(parts).tolist() if parts else []
            failed = [k for k, v in zip(pending, vals) if not v]
            if not failed:
                break
            ok = [None] * len(plans)
            for k in failed:
                stage[k] = 1 if stage[k] == 0 and fused[k] else 2
                out[k], mean[k], ok[k] = run_stage(k, stage[k])
        taylor_passes[0] += stage.count(0)
        return tuple(None if o is None else o[0] for o in out), (vals[-1] if check else None), mean

    avg = lambda ps, qs: tuple(None if p is None else 0.5 * (p + q) for p, q in zip(ps, qs))  # noqa: E731

    def relax(pots, swept, g_from):
        """Over-relaxed alternating update of (f_ba, g_ab) (the sweep's f_ba, then g_ab = g_from(new
        f_ba)), averaged updates of the self terms (already fast: their plans are symmetric)."""
        w = rules.FINISH_OMEGA
        f_ba = (1.0 - w) * pots[0] + w * swept[0]
        g_ab = (1.0 - w) * pots[1] + w * g_from(f_ba)
        return (f_ba, g_ab) + avg(pots[2:], swept[2:])
    def finishing_step(mixer, first, best, err, pots, swept, g_from):
        """(next potentials, kind, gamma): the first step (g is not yet softmin(f)) and any step whose
        error jumped above ANDERSON_RESTART times the best: over-relaxed, with a fresh history;
        otherwise Anderson on T(f) = softmin(softmin(f)) for (f_ba, g_ab) (multiscale_anderson),
        g_ab = softmin(f_ba); the self terms averaged."""
        if first or err > rules.ANDERSON_RESTART * best:
            mixer.reset()
            return relax(pots, swept, g_from), "finish", None
        f_next, gamma = mixer.step(pots[0], swept[0])
        return (f_next, g_from(f_next)) + avg(pots[2:], swept[2:]), "anderson", gamma
    # PARAMS [eps, S] of every eps, one row each, padded to 16 bytes (every row aligned as a lone PARAMS
    # array is: Triton specializes pointers on it), in one non-blocking copy
    prm_rows = to_device(torch.tensor([[e, S, 0.0, 0.0] for e in eps_list], dtype=torch.float32), dev)
    prms = list(prm_rows)
    coarse_finish = 0
    if tol is not None:  # the whole schedule on the clusters, converged there, then lifted at blur^2
        jump = len(eps_list) - 1
    coarse = _CoarsePhase(Xc, Yc, lac, lbc, cx.weight.float(), cy.weight.float(), prm_rows, precision, debias,
                          (jump, tol is not None))
    pots = coarse.anneal(jump)
    if tol is not None:
        mixer, best = AndersonMixer(rules.ANDERSON_DEPTH), float("inf")
        while coarse_finish < rules.MAX_COARSE_SWEEPS:
            swept, err = coarse.check(pots)
            if err <= rules.COARSE_TOL_FRACTION * tol:
                break
            pots, kind, gamma = finishing_step(mixer, coarse_finish == 0, best, err, pots, swept,
                                               lambda f: dense(Yc, Xc, f, lac, prms[-1]))
            best = min(best, err)
            if trace is not None:
                trace.append((eps_list[-1], None, "coarse_" + kind, None if gamma is None else gamma.cpu()))
            coarse_finish += 1
    f_ba, g_ab, f_aa, g_bb = pots  # coarse-to-fine extrapolation at eps_jump
    first_keep = first_fits = None
    if _truncated_lift(truncate is not None, tol is not None, x.shape[0] + y.shape[0], cx.k + cy.k):
        # at blur^2, where the first fine sweep runs too: its masks from bounds on the lifted
        # potentials (no lifted potential needed), and the lift over those masks' pairs only
        first_fits = lifted_fits(pots, prms[-1], eps_list[-1])
        first_keep = keeps(first_fits, eps_list[-1])
        pots = lift_truncated(pots, first_keep, first_fits, prms[-1])
    else:
        pots = (dense(X, Yc, g_ab, lbc, prms[jump]), dense(Y, Xc, f_ba, lac, prms[jump]),
                dense(X, Xc, f_aa, lac, prms[jump]) if debias else None,
                dense(Y, Yc, g_bb, lbc, prms[jump]) if debias else None)

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
        keep = masks(pots, eps_list[k])[0]
        rng = ranges_of(keep)
        if trace is not None:
            trace.append((eps_list[k], rng.all(), "average"))
        pots = avg(pots, fine_sweep(rng, keep, pots, prms[k], eps_list[k], False)[0])
        sweeps += 1
    mixer, best = AndersonMixer(rules.ANDERSON_DEPTH), float("inf")
    while True:  # finishing sweeps; the one whose check passes is the last extrapolation
        covered = first_keep is not None
        if covered:  # the lift's masks; for the dropped-mass bound, their fits raised to cover the lifted potentials
            keep, fits_old, first_keep = first_keep, covers(first_fits, pots), None
        else:
            keep, fits_old = masks(pots, eps_list[-1])
        rng = ranges_of(keep)
        final, errs, mean = fine_sweep(rng, keep, pots, prms[-1], eps_list[-1], tol is not None, last=True)
        sweeps += 1
        err = errs  # a float with tol (fine_sweep's one host read), else None
        if tol is None or err <= tol or finish >= rules.MAX_FINISH_SWEEPS:
            if trace is not None:
                trace.append((eps_list[-1], rng.all(), "final"))
            break
        g_from = lambda f, rng=rng, pold=pots[1]: lse_blocksparse(Y, X, f, prms[-1], rng[1], precision,  # noqa: E731
                                                                  logw_in=la, pold=pold, compute_err=False, fold=True)[0]
        pots, kind, gamma = finishing_step(mixer, finish == 0, best, err, pots, final, g_from)
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
        fits_new = covers(fits_old, final) if covered else fits_of(final)
        bound = (mb.dropped_mass(gx, fits_new[0], gy, fits_old[1], eps, keep[0])
                 + mb.dropped_mass(gy, fits_new[1], gx, fits_old[0], eps, keep[1]))
        if debias:
            bound += (mb.dropped_mass(gx, fits_new[2], gx, fits_old[2], eps, keep[2])
                      + mb.dropped_mass(gy, fits_new[3], gy, fits_old[3], eps, keep[3]))
    # the ranges direction() may use: the means' plans whose mean is missing
    rng.build([k for k in range(len(keep)) if mean[k] is None and keep[k] is not None and means[(0, 1, 0, 1)[k]]])
    bound, kept = torch.stack([bound.double(), _kept_fraction(keep[0])]).tolist()  # one host read
    rng.release()
    # the HVP's plans (multiscale_hvp): the last sweep's cluster masks (xy, xx, yy; None: nothing truncated)
    extra = {"keep": (keep[0], keep[2], keep[3]) if truncate is not None else None, "labels": (cx.label, cy.label), "weights": (a_s, b_s),
             "means": tuple(mean)}
    plans = {"xy": (X, Y, pots[1], lb, rng.getter(0)), "yx": (Y, X, pots[0], la, rng.getter(1)),
             "xx": (X, X, pots[2], la, rng.getter(2)), "yy": (Y, Y, pots[3], lb, rng.getter(3))}
    return MultiscaleResult(new=back(final), old=back(pots), eps=eps_list, jump=jump,
                            kept=kept, clusters=(cx.k, cy.k), sweeps=sweeps,
                            finish_sweeps=finish, coarse_finish_sweeps=coarse_finish, marginal_error=err,
                            taylor_passes=taylor_passes[0],
                            converged=converged,
                            dropped_mass_bound=bound,
                            state=(final, plans, prms[-1], (cx.perm, cy.perm), extra))


def _coarse_sweep(Xc: Cloud, Yc: Cloud, lac: Tensor, lbc: Tensor, wx: Tensor, wy: Tensor, pots: tuple, prm: Tensor,
                  precision: str, debias: bool, check: bool = False) -> tuple:
    """One sweep of the four LSE updates on the clusters (weights wx, wy; log-weights lac, lbc):
    the new (f_ba, g_ab, f_aa, g_bb) (None without debias), and with ``check`` also the largest
    marginal error of the four plans at ``pots`` as a 0-d device tensor (no host read)."""
    f_ba, g_ab, f_aa, g_bb = pots
    kw = lambda pold: dict(pold=pold) if check else {}  # noqa: E731
    out = [lse_update(Xc, Yc, g_ab, prm, precision, logw_in=lbc, **kw(f_ba)),
           lse_update(Yc, Xc, f_ba, prm, precision, logw_in=lac, **kw(g_ab)), None, None]
    if debias:
        out[2] = lse_update(Xc, Xc, f_aa, prm, precision, logw_in=lac, **kw(f_aa))
        out[3] = lse_update(Yc, Yc, g_bb, prm, precision, logw_in=lbc, **kw(g_bb))
    new = tuple(None if o is None else o[0] for o in out)
    if not check:
        return new
    return new, torch.stack([(w * o[1]).sum() for w, o in zip((wx, wy, wx, wy), out) if o is not None]).max()


_CLOUD_FIELDS = ("x", "hi", "lo", "sqnorm", "scale")


class _CoarsePhase:
    """The coarse sweeps of :func:`anneal`: the annealing (from zero potentials, ``jump`` + 1
    averaged sweeps after the first) and the finishing loop's checked sweeps at the last eps. Both
    launch fixed sequences of ~100 us kernels between host reads, so the eager loop is host-bound
    (~1 ms of host per sweep at 2^20: bench/NOTES.md 112); where a shape repeats they are replayed
    from CUDA graphs (torch_api.cuda_graphs: one per segment, over static copies of the clusters,
    weights and PARAMS rows; bitwise the eager launches). Potentials they return are the caller's
    (copied out of the graphs' outputs)."""

    def __init__(self, Xc: Cloud, Yc: Cloud, lac: Tensor, lbc: Tensor, wx: Tensor, wy: Tensor, prm_rows: Tensor,
                 precision: str, debias: bool, schedule: tuple):
        self.precision, self.debias = precision, debias
        values = {"lac": lac, "lbc": lbc, "wx": wx, "wy": wy, "prms": prm_rows}
        for tag, c in (("xc", Xc), ("yc", Yc)):
            values.update({f"{tag}.{f}": getattr(c, f) for f in _CLOUD_FIELDS if getattr(c, f) is not None})
        kx, ky = Xc.n, Yc.n
        values.update(f_ba=lac, g_ab=lbc, f_aa=lac if debias else None, g_bb=lbc if debias else None)
        self.graphs = cuda_graphs.graph_set(
            ("multiscale_coarse", kx, ky, Xc.d, precision, debias, prm_rows.shape[0], schedule, tuple(values)),
            lac.device, kx * ky, {k: v for k, v in values.items() if v is not None})
        self.eager = (Xc, Yc, lac, lbc, wx, wy, prm_rows)
        if self.graphs is not None:
            self.graphs.load({k: v for k, v in values.items() if v is not None and k not in ("f_ba", "g_ab", "f_aa", "g_bb")})

    def _args(self, s: dict | None) -> tuple:
        if s is None:
            return self.eager
        clouds_ = [Cloud(*(s.get(f"{tag}.{f}") for f in _CLOUD_FIELDS)) for tag in ("xc", "yc")]
        return (*clouds_, s["lac"], s["lbc"], s["wx"], s["wy"], s["prms"])

    def _annealed(self, s, jump: int) -> tuple:
        Xc, Yc, lac, lbc, wx, wy, prms = self._args(s)
        zx, zy = torch.zeros(Xc.n, device=lac.device), torch.zeros(Yc.n, device=lac.device)
        pots = _coarse_sweep(Xc, Yc, lac, lbc, wx, wy, (zx, zy, zx, zy), prms[0], self.precision, self.debias)
        for k in range(jump + 1):
            new = _coarse_sweep(Xc, Yc, lac, lbc, wx, wy, pots, prms[k], self.precision, self.debias)
            pots = tuple(None if p is None else 0.5 * (p + q) for p, q in zip(pots, new))
        return pots

    def anneal(self, jump: int) -> tuple:
        """The potentials after the annealing sweeps (GeomLoss's averaged updates) up to eps_jump."""
        if self.graphs is None:
            return self._annealed(None, jump)
        return _copied(self.graphs.run("anneal", lambda s: self._annealed(s, jump)))

    def check(self, pots: tuple) -> tuple:
        """(the sweep at the last eps from ``pots``, the largest marginal error at ``pots`` as a float)."""
        if self.graphs is None:
            new, err = _coarse_sweep(*self.eager[:6], pots, self.eager[6][-1], self.precision, self.debias, True)
            return new, float(err)
        self.graphs.load({k: p for k, p in zip(("f_ba", "g_ab", "f_aa", "g_bb"), pots) if p is not None})

        def body(s):
            Xc, Yc, lac, lbc, wx, wy, prms = self._args(s)
            start = (s["f_ba"], s["g_ab"], s.get("f_aa"), s.get("g_bb"))
            new, err = _coarse_sweep(Xc, Yc, lac, lbc, wx, wy, start, prms[-1], self.precision, self.debias, True)
            return new + (err,)
        out = self.graphs.run("check", body, read=True)
        return _copied(out[:-1]), float(out[-1])


def _copied(pots: tuple) -> tuple:
    return tuple(None if p is None else p.clone() for p in pots)


def _truncated_lift(truncated: bool, check: bool, points: int, clusters: int) -> bool:
    """Whether anneal lifts over the first sweep's masks (``LIFT``): only with truncation and ``tol``
    (the lift is then at blur^2, the first fine sweep's eps)."""
    if LIFT not in ("auto", "always", "never"):
        raise ValueError(f"torch_api.multiscale_solve.LIFT must be 'auto', 'always' or 'never', got {LIFT!r}")
    if not (truncated and check) or LIFT == "never":
        return False
    return LIFT == "always" or rules.lift_truncated_worthwhile(points, clusters)


_RELEASED = object()


class _Ranges:
    """The four plans' column ranges (multiscale_clusters.kept_ranges), each built at its first use
    and kept: the direct passes, direction()'s fallback and the trace need them; a sweep whose
    plans all take the Taylor pass does not (two ~1 ms kernels per mask at 2^20)."""

    def __init__(self, keep, labels, starts, block_m):
        self.keep, self.labels, self.starts, self.block_m = keep, labels, starts, block_m
        self.built = [None] * len(keep)

    def __getitem__(self, k):
        if self.built[k] is None and self.keep[k] is not None:
            if self.keep[k] is _RELEASED:
                raise RuntimeError(f"multiscale_solve: plan {k}'s column ranges were not built during the solve and "
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


def _kept_fraction(keep: Tensor) -> Tensor:
    """The fraction of True in a (K_x, K_y) mask (float64, 0-d, on its device), counted 1024 rows at
    a time: a whole-mask sum (or count_nonzero) first casts it to int64, 8 bytes per cluster pair
    (1.9 GB at K = 15 625)."""
    counts = torch.stack([c.sum() for c in keep.split(1024)]) if keep.shape[0] else keep.new_zeros(1, dtype=torch.int64)
    return counts.sum().double() / max(keep.numel(), 1)


_PREWARMED: set = set()


def start_first_call() -> None:
    """The first multiscale solve of a process: start the compile workers (and this process's
    Triton setup, launch.spawn_compile_workers) now, so that they overlap the caller's input checks
    and the clustering instead of waiting for the kernel list; a no-op after that."""
    if not _PREWARMED:
        spawn_compile_workers()


def kernel_descriptions(n: int, m: int, kx: int, ky: int, d: int, precision: str, debias: bool, check: bool,
                        means: tuple, truncated: bool, orders: tuple = (rules.TAYLOR_ORDERS[:1],) * 2) -> list:
    """Every kernel description :func:`anneal` launches for n x m points in K_x x K_y clusters
    (``check``: with ``tol``; ``truncated``: truncate is not None; ``orders``: the Taylor pass's
    orders without and with the mean, :func:`_taylor_orders`), for :func:`_prewarm`. The
    block-sparse kernels do not specialize on their runs per row block (given as 2 here).
    tests/test_multiscale_prewarm.py checks this list against the launches of real solves."""
    g = runtime.on_gpu()
    seqs, sizes, n_amax = [kc.center(n, ky, d, g)], (n, m, kx, ky), 0
    if launch_plans.fp16_operands(d):  # kernel_ops.clouds's scale pass (not at d <= 3 today)
        seqs += [kc.absmax(sizes[i], sizes[j], d, g) for i, j in kc.absmax_pairs(len(sizes))]
        n_amax = sum(s.calls[0].plan.grid[0] for s in seqs[1:])
    seqs += [kc.split_centered(k, d, g, n_amax) for k in sizes]
    coarse, lifts = [(kx, ky), (ky, kx)], [(n, ky), (m, kx)]
    fine = [(n, m, 0), (m, n, 1)]
    bounds, dropped = [(kx, ky)], [(kx, ky), (ky, kx)]
    if debias:
        coarse, lifts = coarse + [(kx, kx), (ky, ky)], lifts + [(n, kx), (m, ky)]
        fine += [(n, n, 0), (m, m, 1)]
        bounds, dropped = bounds + [(kx, kx), (ky, ky)], dropped + [(kx, kx), (ky, ky)]
    for p, q in coarse:
        seqs.append(kc.lse_update(p, q, d, precision, g, True, False, False, False, False))
        if check:
            seqs.append(kc.lse_update(p, q, d, precision, g, True, False, True, True, False))
    if _truncated_lift(truncated, check, n + m, kx + ky):  # the lifts over the first sweep's masks (anneal)
        seqs += [kc.apply_plan(p, q, d, d, precision, g) for p, q in coarse]
        seqs += [mc.lift_gathered(rows, k, d, g) for rows, k in ((n, kx), (m, ky))]
        seqs += [s for p, q in coarse for s in (mc.mask_row_counts(p, q, g), mc.mask_row_lists(p, q, g, False))]
    else:
        seqs += [kc.lse_update(p, q, d, precision, g, True, False, False, False, False) for p, q in lifts]
    if truncated:
        seqs += [s for i, (p, q) in enumerate(bounds) for s in (mc.pair_keep(p, q, d, g, i == 0), mc.pair_fixup(p, q, d, g, i == 0))]
        seqs += [mc.pair_dropped(p, q, d, g) for p, q in dropped]
    block_m = multiscale_plans.blocksparse_block_m(d, precision, g)
    ranges = [(n, ky), (m, kx)] + ([(n, kx), (m, ky)] if debias else [])
    for rows, kc_ in ranges:
        blocks = -(-rows // block_m)
        seqs += [mc.block_run_counts(blocks, kc_, g), mc.block_run_ranges(blocks, kc_, 2, g)]
    for p, q, side in fine:
        seqs += [mc.lse_blocksparse(p, q, d, 2, precision, g, True, False, err, True) for err in {check, False}]
        if means[side]:
            seqs.append(mc.apply_plan_blocksparse(p, q, d, 2, d, precision, g, launch_plans.packed_operands(d)))
    # the Taylor pass (multiscale_taylor), where MODE asks for it on some plan (its pair counts are not specialized on)
    per = (n / max(kx, 1), m / max(ky, 1))
    plans = [(0, 1), (1, 0)] + ([(0, 0), (1, 1)] if debias else [])
    # the plain evaluation for the plans without a mean, and with tol=None for the schedule's sweeps
    # before the last; the one with the mean where a plan that gives it takes the Taylor pass
    plain = [taylor.wanted(per[s], per[t]) and (not means[s] or not check) for s, t in plans]
    mean = [bool(means[s]) and taylor.wanted(per[s], per[t], True) for s, t in plans]
    plain_p, mean_p = (orders[0] if any(plain) else ()), (orders[1] if any(mean) else ())
    if truncated and (plain_p or mean_p):
        every = sorted(set(plain_p) | set(mean_p))
        seqs += [mc.taylor_monomials(k, d, g, o) for k in sorted({n, m}) for o in every]
        seqs += [s for p, q in coarse for s in (mc.mask_row_counts(p, q, g), mc.mask_row_lists(p, q, g, True))]
        seqs += [mc.taylor_moments(1, 1, 0, d, g, o) for o in every]
        seqs += [s for o in mean_p for s in (mc.taylor_monomials(1, d, g, o, True), mc.taylor_evaluate(1, 0, d, g, o, True))]
        seqs += [mc.taylor_evaluate(1, 0, d, g, o) for o in plain_p]
    return seqs


def _taylor_orders(xs: Tensor, ys: Tensor, cx, cy, per_cluster: tuple, eps_fine: list, tol: float | None,
                   debias: bool, means: tuple, truncated: bool) -> tuple:
    """The Taylor orders (without the mean, with it) the fine sweeps at ``eps_fine`` may take, from
    the sorted clouds' largest radii around their clusters' centres (multiscale_taylor.box_centers;
    one host read; the solve's sides take them from the centred clouds: a disagreement in the last
    bit at a bound's edge would only compile a kernel at its first launch); empty where no plan asks
    for the pass."""
    plans = [(0, 1), (1, 0)] + ([(0, 0), (1, 1)] if debias else [])
    wanted = [(s, t) for s, t in plans if taylor.wanted(per_cluster[s], per_cluster[t])]
    wanted_mean = [(s, t) for s, t in plans if means[s] and taylor.wanted(per_cluster[s], per_cluster[t], True)]
    if not truncated or not (wanted or wanted_mean):
        return (), ()
    r = torch.stack([taylor.box_centers(xs, cx.label, cx.k)[1], taylor.box_centers(ys, cy.label, cy.k)[1]]).tolist()
    plain = {rules.taylor_order(r[s] * r[t] / e, tol) for s, t in wanted for e in eps_fine}
    mean = {rules.taylor_order(r[s] * r[t] / eps_fine[-1], tol, True) for s, t in wanted_mean}
    return tuple(sorted(plain - {None})), tuple(sorted(mean - {None}))


def _prewarm(key: tuple, device) -> None:
    """First solve of a shape in this process: compile its kernels in parallel (kernel_ops.prewarm)
    instead of one by one at their first launches (issue 15's first-call target)."""
    if key in _PREWARMED or not runtime.on_gpu():
        return
    if len(_PREWARMED) > 4096:  # cluster counts change with the data: keep the memo bounded
        _PREWARMED.clear()
    _PREWARMED.add(key)
    prewarm(kernel_descriptions(*key), device)


def direction(res: MultiscaleResult, side: int, debias: bool = True, precision: str = "float32") -> Tensor:
    """dF_i/dx_i (side 0) or dG_j/dy_j (side 1), in the points' original order: the derivative of
    the last extrapolation (F = f_ba - f_aa; the other potentials held fixed, as GeomLoss's
    detached second arguments), on the blocks it kept:
    Q x / Q 1 - P y / P 1 (debias) or x - P y / P 1, P and Q the last extrapolation's softmin
    weights over the kept columns. The loss gradient is a_i dF_i/dx_i (b_j dG_j/dy_j)."""
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
    rows = plans[cross][0].x - mean_t
    if debias:
        rows = softmin_mean(own, new[side + 2]) - mean_t
    return rows[torch.argsort(perms[side])]


def _update_and_mean(src, tgt, pot, logw, pold, prm, ranges, precision):
    """The LSE update of ``src`` and the softmin mean of ``tgt``'s points in one plan pass:
    with r_i = sum_j w_j exp((pold_i + pot_j - C_ij) / eps) (P 1 at the old potential),
    f_i = pold_i - eps log r_i, ERR_i = |r_i - 1| (lse_blocksparse's update and error), and
    (P t)_i / r_i is the softmin mean (the old potential cancels). Where the clouds have packed
    FP16 parts (d <= 5) the product with t runs on the tensor cores (TGT_MEAN: the mean exact to
    the FP16 rounding of each P_ij, relative 2^-12, unbiased), which needs every P_ij < 4:
    r_i in [2^-8, 3.9] (an old potential within ~1.4 eps of the new one). Returns ((f, err),
    mean, ok), ok a 0-d device flag (read by the caller with its other checks), False when some r_i
    is outside that range ([2^-100, 2^100] for the float32 product): the caller then discards the
    pass for the shifted LSE kernel, and direction() runs its own passes."""
    eps = prm[0]
    fast = launch_plans.packed_operands(src.d)
    pt, r = apply_plan_blocksparse(src, tgt, pold, pot + eps * logw, prm, ranges, precision,
                                   None if fast else tgt.x, target_mean=fast)
    lo, hi = (2.0 ** -8, 3.9) if fast else (2.0 ** -100, 2.0 ** 100)
    return (pold - eps * torch.log(r), (r - 1.0).abs()), pt / r[:, None], ((r > lo) & (r < hi)).all()
