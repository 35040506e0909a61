"""The sweeps on the points of the multiscale solve (torch; d <= 3).

:func:`fine_sweep` runs one sweep of the four LSE updates at one eps, each plan streaming only the
blocks its truncation mask keeps, by the Taylor pass (:mod:`.taylor`) where it is wanted and meets
the tolerance, else by the direct block-sparse passes: :func:`update_and_mean` (the update and the
gradient's softmin mean in one pass) where a mean is asked, else the fixed-shift LSE kernel. With
relaxed marginals (``Problem.rho``) every plan takes the fixed-shift kernel with its side's RELAX_AT
(the damped update, the relaxed marginal's error); the gradient then runs its own mean passes.
"""

from __future__ import annotations

import torch

from ot_triton_jax.core import launch_plans, multiscale_rules as rules

from ..kernel_ops import apply_plan_blocksparse, lse_blocksparse
from . import taylor
from .problem import Problem, Ranges


def fine_sweep(pb: Problem, rng: Ranges, keep, pots, prm, eps, check, last=False):
    """One sweep: (new potentials, the largest marginal error (a float, from the sweep's one host
    read) or None, softmin means or None).
    ``last``: this sweep may be the last extrapolation: the plans of the sides in ``means``
    give their softmin means too. Each plan takes the Taylor pass (with the mean where asked)
    where taylor.wanted asks for it, an order meets the tolerance (taylor.order)
    and it does not decline, else the direct one (update_and_mean where a mean is asked, else
    lse_blocksparse)."""
    X, Y, la, lb, a_s, b_s, precision = pb.X, pb.Y, pb.la, pb.lb, pb.a_s, pb.b_s, pb.precision
    debias, truncate, tol, means, per_cluster = pb.debias, pb.truncate, pb.tol, pb.means, pb.per_cluster
    taylor_side = pb.taylor_side
    f_ba, g_ab, f_aa, g_bb = pots
    # (src, tgt, potential of tgt, log-weights of tgt, old potential of src, side, tgt side)
    plans = [(X, Y, g_ab, lb, f_ba, 0, 1), (Y, X, f_ba, la, g_ab, 1, 0)]
    if debias:
        plans += [(X, X, f_aa, la, f_aa, 0, 0), (Y, Y, g_bb, lb, g_bb, 1, 1)]
    out, mean, orders = [None] * 4, [None] * 4, {}
    relax = rules.relax_indices(*pb.rho)
    # plans that give the gradient's softmin mean too (relaxed: the direct passes only, multiscale_rules)
    fused = [last and bool(means[p[5]]) and not pb.relaxed for p in plans]
    tay_p = [taylor.order(taylor_side(p[5]), taylor_side(p[6]), eps, tol, fused[k])
             if truncate is not None and keep[k] is not None and not pb.relaxed
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
    # the host then prepares the next one
    build_orders([k for k in range(len(plans)) if use_taylor[k]])

    def run_stage(k, stage):
        """Plan k's pass: 0 Taylor, 1 direct with the mean (update_and_mean), 2 direct (FOLD);
        (the update, the mean or None, the range check's 0-d device flag or None)."""
        src, tgt, pot, logw, pold, side, tside = plans[k]
        if stage == 0:
            res = taylor.lse(taylor_side(side), taylor_side(tside), pot, logw, pold, prm, order(k), check,
                             fused[k], eps=eps, deferred=True, p=tay_p[k])
            return res[:2], (res[2] if fused[k] else None), res[-1]
        if stage == 1:
            return update_and_mean(src, tgt, pot, logw, pold, prm, rng[k], precision)
        # the old potential predicts each row's LSE: the fixed-shift (FOLD) loop, checked in the kernel
        return lse_blocksparse(src, tgt, pot, prm, rng[k], precision, logw_in=logw, pold=pold,
                               compute_err=check, fold=True, relax_at=relax[side]), None, None
    # every plan's pass is launched before any host read: the Taylor and fused passes' range checks
    # are read once, with the marginal error; a pass that fails its check is redone by the next
    # kind (Taylor -> fused where a mean is asked, else plain; fused -> plain), then read again (rare)
    stage = [0 if use_taylor[k] else (1 if fused[k] else 2) for k in range(len(plans))]
    ok = [None] * len(plans)
    for k in range(len(plans)):
        out[k], mean[k], ok[k] = run_stage(k, stage[k])
    w = (a_s, b_s, a_s, b_s)
    # ||P 1 - a||_1 = sum_i a_i err_i (the passes' ERR with POLD, no logw_out; relaxed: the target a exp(-pold / rho))
    while True:
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
    pb.taylor_passes += stage.count(0)
    return tuple(None if o is None else o[0] for o in out), (vals[-1] if check else None), mean


def update_and_mean(src, tgt, pot, logw, pold, prm, ranges, precision):
    """The LSE update of ``src`` and the softmin mean of ``tgt``'s points in one plan pass:
    with r_i = sum_j w_j exp((pold_i + pot_j - C_ij) / eps) (P 1 at the old potential),
    f_i = pold_i - eps log r_i, ERR_i = |r_i - 1| (lse_blocksparse's update and error), and
    (P t)_i / r_i is the softmin mean (the old potential cancels). Where the clouds have packed
    FP16 parts (d <= 5) the product with t runs on the tensor cores (TGT_MEAN: the mean exact to
    the FP16 rounding of each P_ij, relative 2^-12, unbiased), which needs every P_ij < 4:
    r_i in [2^-8, 3.9] (an old potential within ~1.4 eps of the new one). Returns ((f, err),
    mean, ok), ok a 0-d device flag (read by the caller with its other checks), False when some r_i
    is outside that range ([2^-100, 2^100] for the float32 product): the caller then discards the
    pass for the shifted LSE kernel, and gradient.direction runs its own passes."""
    eps = prm[0]
    fast = launch_plans.packed_operands(src.d)
    pt, r = apply_plan_blocksparse(src, tgt, pold, pot + eps * logw, prm, ranges, precision,
                                   None if fast else tgt.x, target_mean=fast)
    lo, hi = (2.0 ** -8, 3.9) if fast else (2.0 ** -100, 2.0 ** 100)
    return (pold - eps * torch.log(r), (r - 1.0).abs()), pt / r[:, None], ((r > lo) & (r < hi)).all()
