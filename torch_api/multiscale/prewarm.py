"""The multiscale solve's first call (torch; d <= 3): the list of every kernel a solve of a given
shape launches (:func:`kernel_descriptions`), compiled in parallel before the solve's first
launch (:func:`prewarm`, keyed by the sizes, the options and the Taylor orders the solve will
take, :func:`taylor_orders`), and the compile workers started as early as possible
(:func:`start_first_call`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ot_triton_jax.core import kernel_calls as kc, launch_plans, multiscale_calls as mc, multiscale_plans
from ot_triton_jax.core import multiscale_rules as rules, runtime

from .. import kernel_ops
from ..launch import spawn_compile_workers
from . import taylor
from .lift import truncated_lift


_PREWARMED: set = set()


def start_first_call() -> None:
    """The first multiscale solve of a process: start the compile workers (and this process's
    Triton setup, launch.spawn_compile_workers) now, so that they overlap the caller's input checks
    and the clustering instead of waiting for the kernel list; a no-op after that."""
    if not _PREWARMED:
        spawn_compile_workers()


def kernel_descriptions(n: int, m: int, kx: int, ky: int, d: int, precision: str, debias: bool, check: bool,
                        means: tuple, truncated: bool, orders: tuple = (rules.TAYLOR_ORDERS[:1],) * 2) -> list:
    """Every kernel description solve.anneal launches for n x m points in K_x x K_y clusters
    (``check``: with ``tol``; ``truncated``: truncate is not None; ``orders``: the Taylor pass's
    orders without and with the mean, :func:`taylor_orders`), for :func:`prewarm`. The
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
    if truncated_lift(truncated, check, n + m, kx + ky):  # the lifts over the first sweep's masks (lift.lift_truncated)
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
    # the Taylor pass (taylor), where MODE asks for it on some plan (its pair counts are not specialized on)
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


def taylor_orders(xs: Tensor, ys: Tensor, cx, cy, per_cluster: tuple, eps_fine: list, tol: float | None,
                   debias: bool, means: tuple, truncated: bool) -> tuple:
    """The Taylor orders (without the mean, with it) the fine sweeps at ``eps_fine`` may take, from
    the sorted clouds' largest radii around their clusters' centres (taylor.box_centers;
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


def prewarm(key: tuple, device) -> None:
    """First solve of a shape in this process: compile its kernels in parallel (kernel_ops.prewarm)
    instead of one by one at their first launches."""
    if key in _PREWARMED or not runtime.on_gpu():
        return
    if len(_PREWARMED) > 4096:  # cluster counts change with the data: keep the memo bounded
        _PREWARMED.clear()
    _PREWARMED.add(key)
    kernel_ops.prewarm(kernel_descriptions(*key), device)
